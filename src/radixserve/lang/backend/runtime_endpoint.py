"""``RuntimeEndpoint``: programs against a radixserve router or engine over HTTP (native ``POST /generate``, SGLang's
field names; docs/contracts.md, "Native POST /generate").

- ``gen``: one ``/generate`` with the program's text so far; streamed gens read its SSE events (incremental text).
- ``select``: one ``/generate`` with ``text`` the list of text + each choice, ``max_new_tokens`` 0,
  ``return_logprob`` and ``logprob_start_len`` a little before where the choices start, so the shared text is
  served from the radix cache and only the choices' tokens are computed and scored. Where that start is not known
  yet (the program has sent nothing so far), a ``cache_prefix`` request first prefills the shared text and reports its
  token count, as SGLang's runtime endpoint does.
- The chat template: the model's own, read off the engine's ``GET /get_tokenizer_files``; behind a router (which
  does not serve that path) from one of the engines its ``GET /health`` lists; else SGLang's template matching the
  model's name (``GET /get_model_info`` or ``/v1/models``); ``chat_template_name`` picks a registered one instead.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from radixserve.contracts import constants
from radixserve.lang.backend.base import PrefixTokens
from radixserve.lang.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    from_tokenizer_files,
    get_chat_template,
    match_chat_template,
)
from radixserve.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, choice_tokens, mean_logprob
from radixserve.lang.global_config import global_config
from radixserve.lang.ir import SglSamplingParams

logger = logging.getLogger("radixserve.lang")

# meta_info fields a stream sends per event for that event's tokens only (joined across events).
_INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs")


class RuntimeEndpointError(RuntimeError):
    """The server answered with an error (``status_code``, None when it broke off mid-stream or sent something that
    is not the native /generate response), or lacks what a program needs."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message if status_code is None else f"{status_code}: {message}")
        self.status_code = status_code


def _raise_if_aborted(meta_info: dict[str, Any]) -> None:
    """Raise ``RuntimeEndpointError`` when the server aborted the request (``finish_reason.type == "abort"``: an
    engine error, a grammar with no continuation, a shutdown), with its message and status. Regression: such a
    result was taken as an empty completion, and the program went on."""
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        status = reason.get("status_code")
        raise RuntimeEndpointError(
            f"the server aborted the request: {reason.get('message') or 'no message'}",
            status if isinstance(status, int) else None,
        )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:500]


def merge_stream_meta(so_far: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """The meta info of a stream up to ``event``: its fields, with the per-event logprob lists joined to those of
    the events before."""
    merged = dict(event)
    for key in _INCREMENTAL_META:
        if key in so_far or key in event:
            merged[key] = [*so_far.get(key, []), *event.get(key, [])]
    return merged


class RuntimeEndpoint:
    """A radixserve router or engine at ``base_url`` as a program backend (SGLang's ``RuntimeEndpoint``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (``radixserve up``'s router) or an engine's ``:30000``.
        api_key: sent as ``Authorization: Bearer``; None for none.
        verify: TLS verification (a CA bundle path, or False); None verifies.
        chat_template_name: a registered template (``chatml``, ``qwen``, ``llama-3-instruct``, ``default``) instead
            of the model's own.
        timeout_s: read timeout of one request, seconds.
        http_client: the httpx client to use (tests pass one over a mock transport).

    Nothing is sent until the first program runs. Errors: ``RuntimeEndpointError``.
    """

    # Tokens before the known prefix length where select's logprobs start: the prefix's last token may merge with
    # the choice's first (SGLang's "token healing" margin).
    HEALING_TOKENS = 2
    # cache_prefix asks for one token: an engine answers a 0-token request without prefilling it.
    CACHE_PREFIX_NEW_TOKENS = 1

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: str | bool | None = None,
        chat_template_name: str | None = None,
        *,
        timeout_s: float = 600.0,
        http_client: httpx.Client | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = http_client or httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            verify=True if verify is None else verify,
        )
        self._chat_template_name = chat_template_name
        self._chat_template: ChatTemplate | None = None
        self.chat_template_source: str | None = None  # where the chat template came from, once known
        self._lock = threading.Lock()

    # -- HTTP ------------------------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            r = self.client.post(self.base_url + path, json=body, headers=self._headers)
        except httpx.HTTPError as e:
            raise RuntimeEndpointError(f"POST {self.base_url}{path} failed: {e}") from e
        if r.status_code != 200:
            raise RuntimeEndpointError(_error_message(r), r.status_code)
        return r.json()

    def _get_json(self, url: str) -> Any | None:
        """``GET url``'s JSON, or None for any failure (used only to discover things)."""
        try:
            r = self.client.get(url, headers=self._headers, timeout=30.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def _request_body(self, text: str | list[str], params: SglSamplingParams) -> dict[str, Any]:
        sampling = params.to_srt_kwargs()
        if not global_config.skip_special_tokens_in_output:
            sampling["skip_special_tokens"] = False
        return {"text": text, "sampling_params": sampling, **params.request_kwargs()}

    @staticmethod
    def _one_result(obj: Any) -> dict[str, Any]:
        if isinstance(obj, list) and obj:
            obj = obj[0]
        if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
            raise RuntimeEndpointError(f"not a native /generate result: {str(obj)[:200]}")
        _raise_if_aborted(obj["meta_info"])
        return obj

    # -- the Backend protocol ----------------------------------------------------------------------------------------

    def get_chat_template(self) -> ChatTemplate:
        """The role markers (found on first use, then kept; see the module docstring)."""
        with self._lock:
            if self._chat_template is None:
                self._chat_template, self.chat_template_source = self._discover_chat_template()
                logger.info("chat template: %s", self.chat_template_source)
            return self._chat_template

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """One ``/generate`` after ``text``: (completion, meta_info). Raises ``RuntimeEndpointError``."""
        result = self._one_result(self._post("/generate", self._request_body(text, params)))
        return str(result.get("text", "")), result["meta_info"]

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """One streamed ``/generate`` after ``text``: (new text, meta_info so far) per SSE event. Raises
        ``RuntimeEndpointError`` for an error status or an error event mid-stream."""
        body = {**self._request_body(text, params), "stream": True}
        try:
            with self.client.stream("POST", self.base_url + "/generate", json=body, headers=self._headers) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeEndpointError(_error_message(r), r.status_code)
                meta: dict[str, Any] = {}
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        error = event["error"]
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise RuntimeEndpointError(f"the stream failed: {message}")
                    meta = merge_stream_meta(meta, event.get("meta_info") or {})
                    _raise_if_aborted(meta)
                    yield str(event.get("text", "")), meta
        except httpx.HTTPError as e:
            raise RuntimeEndpointError(f"streaming POST {self.base_url}/generate failed: {e}") from e

    def cache_prefix(self, text: str) -> int:
        """Prefill ``text`` into the server's radix cache; returns its prompt tokens."""
        body = {"text": text, "sampling_params": {"max_new_tokens": self.CACHE_PREFIX_NEW_TOKENS, "temperature": 0}}
        meta = self._one_result(self._post("/generate", body))["meta_info"]
        tokens = meta.get("prompt_tokens")
        if not isinstance(tokens, int):
            raise RuntimeEndpointError("the server's meta_info has no prompt_tokens")
        return tokens

    def _score(self, texts: list[str], start: int) -> list[dict[str, Any]]:
        """One request: the prompt-token logprobs of each of ``texts`` from token ``start`` on."""
        body = {
            "text": texts,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
        results = self._post("/generate", body)
        if not isinstance(results, list) or len(results) != len(texts):
            raise RuntimeEndpointError(f"expected {len(texts)} results for a list of texts, got {str(results)[:200]}")
        for r in results:
            meta = r.get("meta_info") if isinstance(r, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
                raise RuntimeEndpointError(
                    "the server returned no input_token_logprobs: select needs prompt-token logprobs "
                    "(native /generate with return_logprob and logprob_start_len)"
                )
        return results

    def select(
        self,
        text: str,
        choices: Sequence[str],
        method: ChoicesSamplingMethod,
        prefix: PrefixTokens | None,
    ) -> ChoicesDecision:
        """Score every choice after ``text`` in one request (see the module docstring) and let ``method`` pick.
        Raises ``RuntimeEndpointError`` when the server gives no prompt logprobs."""
        if prefix is not None:
            known = prefix[1]
        else:
            known = self.cache_prefix(text) if text else 0
        start = max(known - self.HEALING_TOKENS, 0)
        results = self._score([text + c for c in choices], start)
        picked = [choice_tokens(r["meta_info"]["input_token_logprobs"], c) for r, c in zip(results, choices)]
        if any(p is None for p in picked) and start > 0:
            # The logprobs started after a choice's first token (the text before it tokenized shorter than the
            # known prefix suggested): score again from the first token.
            results = self._score([text + c for c in choices], 0)
            picked = [choice_tokens(r["meta_info"]["input_token_logprobs"], c) for r, c in zip(results, choices)]
        tokens: list[list[TokenLogprob]] = []
        for p, c in zip(picked, choices):
            if p is None:
                raise RuntimeEndpointError(f"the server's input_token_logprobs do not spell the choice {c!r}")
            tokens.append(p)
        unconditional = None
        if method.requires_unconditional_logprobs:
            body = {
                "input_ids": [[t[1] for t in toks] for toks in tokens],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in self._post("/generate", body)]
        decision = method(
            choices=list(choices),
            normalized_prompt_logprobs=[mean_logprob(t) for t in tokens],
            input_token_logprobs=tokens,
            output_token_logprobs=[r["meta_info"].get("output_token_logprobs", []) for r in results],
            unconditional_token_logprobs=unconditional,
        )
        decision.meta_info["prompt_tokens"] = [r["meta_info"].get("prompt_tokens") for r in results]
        decision.meta_info["cached_tokens"] = [r["meta_info"].get("cached_tokens") for r in results]
        return decision

    def flush_cache(self) -> None:
        """``POST /flush_cache`` (an engine's; a router has no such path). Raises ``RuntimeEndpointError``."""
        self._post("/flush_cache", {})

    def get_server_info(self) -> dict[str, Any]:
        """An engine's ``GET /get_model_info``; behind a router, ``{"models": [...]}`` from ``/v1/models``."""
        info = self._get_json(self.base_url + "/get_model_info")
        if isinstance(info, dict):
            return info
        models = self._get_json(self.base_url + "/v1/models")
        return {"models": models.get("data", []) if isinstance(models, dict) else []}

    def get_model_name(self) -> str | None:
        """The served model's name (``/v1/models``' first), or its path from ``/get_model_info``; None if neither
        answers."""
        models = self._get_json(self.base_url + "/v1/models")
        if isinstance(models, dict) and models.get("data"):
            return str(models["data"][0].get("id"))
        info = self._get_json(self.base_url + "/get_model_info")
        return str(info.get("model_path")) if isinstance(info, dict) and info.get("model_path") else None

    def close(self) -> None:
        """Close the HTTP connections."""
        self.client.close()

    # -- chat template discovery -------------------------------------------------------------------------------------

    def _tokenizer_files(self, url: str) -> dict[str, str] | None:
        body = self._get_json(url + constants.ENGINE_TOKENIZER_FILES_PATH)
        files = body.get("files") if isinstance(body, dict) else None
        return files if isinstance(files, dict) else None

    def _engines_behind_router(self) -> list[str]:
        """The engine URLs a router's ``GET /health`` lists, healthy ones first ([] for an engine: its /health has
        no body)."""
        health = self._get_json(self.base_url + constants.ROUTER_HEALTH_PATH)
        workers = health.get("workers") if isinstance(health, dict) else None
        if not isinstance(workers, list):
            return []
        listed = [w for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]
        listed.sort(key=lambda w: w.get("state") != "healthy")
        return [str(w["url"]).rstrip("/") for w in listed]

    def _discover_chat_template(self) -> tuple[ChatTemplate, str]:
        if self._chat_template_name is not None:
            return get_chat_template(self._chat_template_name), f"{self._chat_template_name} (chat_template_name)"
        files, url = self._tokenizer_files(self.base_url), self.base_url
        if files is None:  # a router: ask the engines it lists
            for url in self._engines_behind_router():
                files = self._tokenizer_files(url)
                if files is not None:
                    break
        if files is not None:
            try:
                template = from_tokenizer_files(files)
            except ChatTemplateError as e:
                logger.warning("the model's chat template from %s: %s; matching by model name instead", url, e)
            else:
                if template is not None:
                    return template, f"the model's own, from {url}{constants.ENGINE_TOKENIZER_FILES_PATH}"
        name = self.get_model_name() or ""
        template = match_chat_template(name)
        return template, f"{template.name} (matched to the model name {name!r})"
