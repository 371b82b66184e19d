"""``radixserve render -f isvc.yaml``: the Kubernetes objects an InferenceService becomes, printed offline.

The same pure steps a reconcile runs before it writes anything (``handlers.Reconciler``): parse the object with the
API model (``spec.InferenceService``), check its name, ``render.render_children``. No cluster, no credentials, no
kopf: the output (YAML documents separated by ``---``, in the order the operator applies them, no anchors or
aliases) can be reviewed, diffed or piped to ``kubectl apply --dry-run=server -f -``. Objects carry no
ownerReferences (there is no uid offline) and no status. Input: one or more files (``-`` is stdin), each one or more
YAML documents, every one an InferenceService; a file without a namespace renders into ``--namespace`` (default
``default``, as kubectl).

Exit status 0; 2 with one line on stderr (``radixserve render: FILE: ...``) for a missing file, bad YAML, a document
that is not an InferenceService, or a spec that fails validation (the message the operator would put in its
Degraded condition). An API key flag in ``spec.*.args`` is a warning on stderr, as the operator's Event.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import pydantic
import yaml

from radixserve.contracts import constants
from radixserve.operator.main import DEFAULT_IMAGE, PULL_POLICIES
from radixserve.operator.render import RenderOptions, render_children
from radixserve.operator.spec import InferenceService, check_name, format_validation_error

__all__ = ["RenderError", "add_render_args", "render_documents", "main"]

API_VERSION = f"{constants.API_GROUP}/{constants.API_VERSION}"


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no type stubs
    """Multi-line strings (the ConfigMap's JSON) as ``|`` blocks, as kubectl prints them; no anchors / aliases.

    The render functions share one dict between objects (a selector's ``matchLabels`` and its pod ``labels``), which
    PyYAML would print once as ``&id001`` and then as ``*id001``: correct YAML, hard to review (issue 11, round 2).
    """

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: Any, value: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


class RenderError(ValueError):
    """An input that cannot be rendered; the message is the one line printed."""


def add_render_args(parser: argparse.ArgumentParser) -> None:
    """The ``radixserve render`` flags."""
    parser.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        dest="filenames",
        help="InferenceService manifest (YAML, several documents allowed; - for stdin); repeat for several files",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        default="default",
        help="namespace of InferenceServices whose metadata names none (default: default)",
    )
    parser.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"the operator's --image: engine and router pods use it unless the spec names one "
        f"(default {DEFAULT_IMAGE})",
    )
    parser.add_argument(
        "--image-pull-policy",
        choices=PULL_POLICIES,
        default=None,
        help="the operator's --image-pull-policy (default: Kubernetes' own)",
    )


def _parse(doc: Any, where: str, namespace: str) -> InferenceService:
    if not isinstance(doc, dict) or doc.get("kind") != constants.CRD_KIND or doc.get("apiVersion") != API_VERSION:
        got = f"{doc.get('apiVersion')} {doc.get('kind')}" if isinstance(doc, dict) else type(doc).__name__
        raise RenderError(f"{where}: expected apiVersion {API_VERSION}, kind {constants.CRD_KIND}; got {got}")
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        raise RenderError(f"{where}: metadata.name is missing")
    body = {**doc, "metadata": {"namespace": namespace, **meta}}
    try:
        check_name(str(meta["name"]))
        return InferenceService.model_validate(body)
    except pydantic.ValidationError as exc:
        raise RenderError(f"{where}: invalid spec: {format_validation_error(exc)}") from None
    except ValueError as exc:
        raise RenderError(f"{where}: {exc}") from None


def render_documents(
    text: str, source: str, options: RenderOptions, namespace: str, warn: TextIO | None = None
) -> list[dict[str, Any]]:
    """The children of every InferenceService in the YAML ``text`` (named ``source`` in messages), in order.
    Raises RenderError (one line) for anything the operator would not apply; writes plain-text key warnings to
    ``warn``."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"{source}: not YAML: {' '.join(str(exc).split())}") from None
    if not docs:
        raise RenderError(f"{source}: no YAML document")
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        where = source if len(docs) == 1 else f"{source} (document {i + 1})"
        isvc = _parse(doc, where, namespace)
        try:
            out += render_children(isvc, options)
        except ValueError as exc:
            raise RenderError(f"{where}: {exc}") from None
        for found in isvc.spec.plain_text_keys():
            if warn is not None:
                print(
                    f"radixserve render: warning: {where}: {found} is stored in plain text; use apiKeySecretRef",
                    file=warn,
                )
    return out


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    try:
        with open(filename, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise RenderError(f"{filename}: {exc.strerror or exc}") from None


def main(ns: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``radixserve render`` with parsed flags; returns the exit status (module doc)."""
    out = out or sys.stdout
    err = err or sys.stderr
    options = RenderOptions(ns.image, ns.image_pull_policy)
    objects: list[dict[str, Any]] = []
    try:
        for filename in ns.filenames:
            source = "<stdin>" if filename == "-" else filename
            objects += render_documents(_read(filename), source, options, ns.namespace, warn=err)
    except RenderError as exc:
        print(f"radixserve render: {exc}", file=err)
        return 2
    out.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True))
    return 0
