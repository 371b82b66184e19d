"""The contracts every wing may import: constants, protocol types, the HTTP edge, SSE framing, serving, the
Kubernetes client. Nothing here imports a wing (``.importlinter``)."""
