"""Chat templates for models whose file carries none, one per turn format.

Each is our own Jinja for a format llama.cpp knows by name (its built-in
templates), written to give the same turns: the markers each family was
trained on. :mod:`formats.chat_templates` picks one by architecture.

They render under the worker's environment (``trim_blocks``,
``lstrip_blocks``), so each is written as one logical line of tags; the
message dicts carry string content ("" for none). None of them names the
request's tool list: such a model gets tools in llama.cpp's generic format,
which the parent puts in the prompt (supervisor/generation/profile.py).

A system message is kept where the format has a place for one, and merged
into the first user turn where it has none (Gemma, Mistral v3), as
llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass

# The text of a message, as most of these formats want it: trimmed.
_TEXT = "((message['content'] or '') | trim)"


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    source: str
    # Where a generation ends, as text: the turn's end and the next turn's
    # start (the engine also stops at the vocab's end-of-generation tokens).
    stops: tuple[str, ...]


def _simple_turns(open_: str, between: str, close: str, generation: str) -> str:
    """Every message as ``open_ role between text close``; then ``generation``."""
    return (
        "{% for message in messages %}"
        f"{{{{ '{open_}' + message['role'] + '{between}' + {_TEXT} + '{close}' }}}}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '{generation}' }}}}{{% endif %}}"
    )


_GEMMA = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{% set ns.system = ns.system + {_TEXT} %}}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
    f"{{{{ {_TEXT} + '<end_of_turn>\\n' }}}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Llama 2 chat: the system prompt inside the first [INST] block; every
# exchange its own BOS ... EOS sequence (the renderer drops the first BOS,
# which the tokenizer adds itself).
_LLAMA2 = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{% set ns.system = {_TEXT} %}}"
    "{% elif message['role'] == 'assistant' %}"
    f"{{{{ ' ' + {_TEXT} + ' ' + eos_token }}}}"
    "{% else %}"
    "{{ bos_token + '[INST] ' }}"
    "{% if ns.system %}{{ '<<SYS>>\\n' + ns.system + '\\n<</SYS>>\\n\\n' }}{% set ns.system = '' %}{% endif %}"
    f"{{{{ {_TEXT} + ' [/INST]' }}}}"
    "{% endif %}"
    "{% endfor %}"
)

# Mistral v3 ([INST] is a control token): no system turn, so a system
# message opens the next user turn.
_MISTRAL_V3 = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{% set ns.system = {_TEXT} %}}"
    "{% elif message['role'] == 'assistant' %}"
    f"{{{{ ' ' + {_TEXT} + eos_token }}}}"
    "{% else %}"
    "{{ '[INST] ' }}"
    "{% if ns.system %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
    f"{{{{ {_TEXT} + '[/INST]' }}}}"
    "{% endif %}"
    "{% endfor %}"
)

# Mistral v7 as its tekken (byte-level BPE) releases write it: a system turn
# of its own, no spaces around the markers.
_MISTRAL_V7_TEKKEN = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{{{ '[SYSTEM_PROMPT]' + {_TEXT} + '[/SYSTEM_PROMPT]' }}}}"
    "{% elif message['role'] == 'assistant' %}"
    f"{{{{ {_TEXT} + eos_token }}}}"
    "{% else %}"
    f"{{{{ '[INST]' + {_TEXT} + '[/INST]' }}}}"
    "{% endif %}"
    "{% endfor %}"
)

_COMMAND_R = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set marker = '<|SYSTEM_TOKEN|>' %}"
    "{% elif message['role'] == 'assistant' %}{% set marker = '<|CHATBOT_TOKEN|>' %}"
    "{% else %}{% set marker = '<|USER_TOKEN|>' %}{% endif %}"
    f"{{{{ '<|START_OF_TURN_TOKEN|>' + marker + {_TEXT} + '<|END_OF_TURN_TOKEN|>' }}}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)

# DeepSeek V2: plain-text turns; the system prompt stands first, alone.
_DEEPSEEK2 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{{{ {_TEXT} + '\\n\\n' }}}}"
    "{% elif message['role'] == 'assistant' %}"
    f"{{{{ 'Assistant: ' + {_TEXT} + eos_token }}}}"
    "{% else %}"
    f"{{{{ 'User: ' + {_TEXT} + '\\n\\n' }}}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

_DEEPSEEK3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    f"{{{{ {_TEXT} }}}}"
    "{% elif message['role'] == 'assistant' %}"
    f"{{{{ '<｜Assistant｜>' + {_TEXT} + eos_token }}}}"
    "{% else %}"
    f"{{{{ '<｜User｜>' + {_TEXT} }}}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_EXAONE3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    f"{{{{ '[|assistant|]' + {_TEXT} + '[|endofturn|]\\n' }}}}"
    "{% elif message['role'] == 'system' %}"
    f"{{{{ '[|system|]' + {_TEXT} + '[|endofturn|]\\n' }}}}"
    "{% else %}"
    f"{{{{ '[|user|]' + {_TEXT} + '\\n' }}}}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[|assistant|]' }}{% endif %}"
)

_CHATGLM4 = (
    "{{ '[gMASK]<sop>' }}"
    "{% for message in messages %}"
    f"{{{{ '<|' + message['role'] + '|>\\n' + {_TEXT} }}}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {t.name: t for t in (
    BuiltinTemplate("gemma", _GEMMA, ("<end_of_turn>", "<start_of_turn>")),
    BuiltinTemplate("llama2", _LLAMA2, ("[INST]",)),
    BuiltinTemplate("llama3", _simple_turns("<|start_header_id|>", "<|end_header_id|>\\n\\n", "<|eot_id|>",
                                            "<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
                    ("<|eot_id|>", "<|start_header_id|>")),
    BuiltinTemplate("llama4", _simple_turns("<|header_start|>", "<|header_end|>\\n\\n", "<|eot|>",
                                            "<|header_start|>assistant<|header_end|>\\n\\n"),
                    ("<|eot|>", "<|header_start|>")),
    BuiltinTemplate("mistral-v3", _MISTRAL_V3, ("[INST]",)),
    BuiltinTemplate("mistral-v7-tekken", _MISTRAL_V7_TEKKEN, ("[INST]", "[SYSTEM_PROMPT]")),
    BuiltinTemplate("phi3", _simple_turns("<|", "|>\\n", "<|end|>\\n", "<|assistant|>\\n"),
                    ("<|end|>", "<|user|>")),
    BuiltinTemplate("phi4", _simple_turns("<|im_start|>", "<|im_sep|>", "<|im_end|>",
                                          "<|im_start|>assistant<|im_sep|>"),
                    ("<|im_end|>", "<|im_start|>")),
    BuiltinTemplate("command-r", _COMMAND_R, ("<|END_OF_TURN_TOKEN|>", "<|START_OF_TURN_TOKEN|>")),
    BuiltinTemplate("deepseek2", _DEEPSEEK2, ("User:",)),
    BuiltinTemplate("deepseek3", _DEEPSEEK3, ("<｜User｜>",)),
    BuiltinTemplate("granite", _simple_turns("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>\\n",
                                             "<|start_of_role|>assistant<|end_of_role|>"),
                    ("<|end_of_text|>", "<|start_of_role|>")),
    BuiltinTemplate("exaone3", _EXAONE3, ("[|endofturn|]", "[|user|]")),
    BuiltinTemplate("chatglm4", _CHATGLM4, ("<|user|>", "<|observation|>")),
)}
