"""The frontend language: LLM programs (SGLang's spelling), run against this project's server.

``import serving.lang as sgl``::

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])

Files: api.py (gen, select, roles), ir.py (expressions), state.py (``s``, forks),
interpreter.py (one worker thread per state), program.py (``@function``, run, run_batch),
chat_template.py, choices.py (select's normalisations), backends/.
"""

from serving.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from serving.lang.backends import Anthropic, EngineBackend, OpenAI, RuntimeEndpoint
from serving.lang.chat_template import ChatTemplate
from serving.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    sum_logprob,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from serving.lang.errors import BackendError, LangError
from serving.lang.program import SglFunction, function, get_default_backend, set_default_backend
from serving.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Anthropic", "BackendError", "ChatTemplate", "ChoicesMethod", "EngineBackend", "LangError", "OpenAI",
    "ProgramState", "ProgramStateGroup", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "function", "gen", "gen_int", "gen_string", "get_default_backend", "greedy_token_selection",
    "select", "set_default_backend", "sum_logprob", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
