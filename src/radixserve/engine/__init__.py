"""The radixserve inference engine: model forward over a pooled KV cache, RadixAttention, continuous batching."""
