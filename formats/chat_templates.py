"""Chat templates known by text: the ChatML template that stands in for a
model whose file has none. The worker renders with it; the parent reads it
to tell how such a model's output is parsed."""

from __future__ import annotations

CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Where a generation with the fallback template ends.
FALLBACK_STOPS = ("<|im_end|>", "<|im_start|>")
