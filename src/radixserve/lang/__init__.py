"""SGLang's frontend language on radixserve: ``import radixserve.lang as sgl`` runs programs written for
``import sglang as sgl`` against a radixserve router or engine (docs/lang.md).

```python
import radixserve.lang as sgl

@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))

sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:8000"))
print(qa.run(question="What is the capital of France?")["answer"])
```

It imports only ``radixserve.contracts`` and talks HTTP (httpx); chat templates render with jinja2.
"""

from radixserve.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.lang.backend.base import Backend
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint, RuntimeEndpointError
from radixserve.lang.chat_template import ChatTemplate, get_chat_template, register_chat_template
from radixserve.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.lang.function import SglFunction
from radixserve.lang.global_config import global_config
from radixserve.lang.interpreter import ProgramError, ProgramState, ProgramStateGroup

__all__ = [
    "Backend",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "RuntimeEndpointError",
    "SglFunction",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "register_chat_template",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
