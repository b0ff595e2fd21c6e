"""Chat templates a config may name (``chat_template: chatml``); any other template is given as its
Jinja text. ``chatml`` is the standard ChatML format, the same text mergekit 0.1.5 writes for it."""

from __future__ import annotations

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}\n"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n")

CHAT_TEMPLATES = {"chatml": CHATML}
