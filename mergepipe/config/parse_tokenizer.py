"""The tokenizer keys of a config as written (:func:`_tokenizer`): ``tokenizer_source`` or the
``tokenizer:`` block (source, tokens, pad_to_multiple_of), and ``chat_template``."""

from __future__ import annotations

from mergepipe.config.model import ConfigError, TOKENIZER_KEYS
from mergepipe.config.templates import CHAT_TEMPLATES
from mergepipe.errors import brief


def _token_source(tok: str, src):
    """A ``tokens:`` entry's source as written: a model reference (str), ``("zero",)``, or
    ``(model reference, token or token_id)`` (mergekit's ``kind: model_token``); None: none given."""
    if src is None or isinstance(src, str):
        return src
    where = f"tokenizer.tokens.{tok}.source"
    if not isinstance(src, dict) or src.get("kind") not in ("zero", "model_token"):
        raise ConfigError(f"{where} must be a model, {{kind: zero}} or {{kind: model_token, model, token | token_id}}")
    if src["kind"] == "zero":
        if set(src) != {"kind"}:
            raise ConfigError(f"{where}: kind: zero takes no other key")
        return ("zero",)
    keys = set(src) - {"kind", "model"}
    if not isinstance(src.get("model"), str) or len(keys) != 1 or keys - {"token", "token_id"}:
        raise ConfigError(f"{where}: kind: model_token needs `model` and one of `token`, `token_id`")
    value = src.get("token", src.get("token_id"))
    if "token" in src and not isinstance(value, str) or "token_id" in src and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{where}: token must be a string, token_id a non-negative integer")
    return (src["model"], value)


def _tokenizer(doc: dict) -> tuple:
    """(tokenizer source: ``union``, a model reference, or None for the base; the ``tokens`` settings as
    ((token, force, source), ...); ``pad_to_multiple_of``; chat_template as written).

    ``tokenizer_source`` or the ``tokenizer:`` block's ``source`` (mergekit's default there: union).
    Whether a union, a model's tokenizer, tokens or padding can be honoured depends on the models'
    vocabularies: the resolver checks (mergepipe.config.resolve)."""
    src = doc.get("tokenizer_source")
    block = doc.get("tokenizer")
    tokens: tuple = ()
    pad = None
    if block is not None:
        if src is not None:
            raise ConfigError("give either `tokenizer_source` or a `tokenizer:` block, not both")
        if not isinstance(block, dict):
            raise ConfigError("`tokenizer` must be a mapping (source, tokens, pad_to_multiple_of)")
        unknown = sorted(set(map(str, block)) - set(TOKENIZER_KEYS))
        if unknown:
            raise ConfigError(f"unsupported key `{unknown[0]}` in tokenizer (mergekit's are "
                              f"{', '.join(TOKENIZER_KEYS)})")
        raw_tokens = block.get("tokens") or {}
        if not isinstance(raw_tokens, dict):
            raise ConfigError("tokenizer.tokens must map tokens to their settings (source, force)")
        out = []
        for tok, setting in raw_tokens.items():
            setting = setting or {}
            if not isinstance(tok, str) or not isinstance(setting, dict) or set(setting) - {"source", "force"}:
                raise ConfigError(f"tokenizer.tokens.{tok}: settings are `source` and `force`")
            force = setting.get("force", False)
            if not isinstance(force, bool):
                raise ConfigError(f"tokenizer.tokens.{tok}.force must be true or false")
            out.append((tok, force, _token_source(tok, setting.get("source"))))
        tokens = tuple(out)
        pad = block.get("pad_to_multiple_of")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise ConfigError("tokenizer.pad_to_multiple_of must be a positive integer")
        src = block.get("source", "union")
        where = "tokenizer.source"
    else:
        where = "tokenizer_source"
    if src is not None and not isinstance(src, str):
        raise ConfigError(f"{where} must be `base`, `union` or a model (a path or a catalog id)")
    template = doc.get("chat_template")
    if template is not None:
        if not isinstance(template, str) or not template.strip():
            raise ConfigError("chat_template must be `auto`, a template name or the template text")
        if template != "auto" and "{" not in template and template not in CHAT_TEMPLATES:
            raise ConfigError(f"chat_template: {brief(template)} is neither `auto`, a known template name "
                              f"({', '.join(sorted(CHAT_TEMPLATES))}) nor a Jinja template (paste its text)")
        if "{" in template and len(template) < 20:
            raise ConfigError(f"chat_template: {brief(template)} is too short to be a Jinja chat template")
    return src, tokens, pad, template
