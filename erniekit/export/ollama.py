"""An Ollama `Modelfile` beside an exported GGUF file: FROM the file, the chat template in Ollama's
Go-template syntax, stop at the end-of-turn and end-of-text tokens, and the sampling defaults of
the checkpoint's generation_config.json.

Only the ERNIE 4.5 default chat template has a Go translation here (the same text for plain
system / user / assistant conversations, tested against the jinja rendering); a checkpoint with
another template gets a Modelfile without TEMPLATE and a comment saying so, never a guess.
"""

from __future__ import annotations

MODELFILE_NAME = "Modelfile"
_REPLY = "\x00erniekit-reply\x00"


def go_template(tokenizer) -> str | None:
    """The chat template as an Ollama TEMPLATE, or None when it is not ERNIE 4.5's default."""
    from erniekit.models.ernie4_5.tokenizer import ERNIE_CHAT_TEMPLATE

    if getattr(tokenizer, "chat_template", None) != ERNIE_CHAT_TEMPLATE:
        return None
    cls, sep = tokenizer.cls_token, tokenizer.sep_token
    return (
        cls + "{{ range .Messages }}"
        '{{ if eq .Role "user" }}User: {{ .Content }}\n'
        '{{ else if eq .Role "assistant" }}Assistant: {{ .Content }}' + sep + '{{ else if eq .Role "system" }}'
        "{{ .Content }}\n{{ end }}{{ end }}Assistant: "
    )


def end_of_turn(tokenizer) -> str | None:
    """The special token the chat template closes an assistant reply with: the first token after
    the reply that decoding drops as special (a text tag like </response> is kept, so skipped)."""
    from erniekit.errors import DataError

    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": _REPLY}], add_generation_prompt=False
        )
    except DataError:  # a template that cannot render a plain reply has no end-of-turn token to find
        return None
    if _REPLY not in text:
        return None
    for i in tokenizer.encode(text.split(_REPLY, 1)[1]):
        if i in tokenizer.all_special_ids and tokenizer.decode([i], skip_special_tokens=True) == "":
            return tokenizer.convert_ids_to_tokens(i)
    return None


def sampling(generation_config: dict) -> dict[str, float | int]:
    """Ollama PARAMETERs from a generation_config.json: greedy (temperature 0) when it does not
    sample, else its temperature / top_p / top_k; its repetition penalty either way."""
    params: dict[str, float | int] = {}
    if generation_config.get("do_sample") is False:
        params["temperature"] = 0
    else:
        for key in ("temperature", "top_p", "top_k"):
            if isinstance(generation_config.get(key), (int, float)) and not isinstance(generation_config[key], bool):
                params[key] = generation_config[key]
    if isinstance(generation_config.get("repetition_penalty"), (int, float)):
        params["repeat_penalty"] = generation_config["repetition_penalty"]
    return params


def modelfile(gguf_file: str, template: str | None, stops: list[str], params: dict) -> str:
    """The Modelfile text; gguf_file is relative to the Modelfile's directory."""
    lines = [f"FROM ./{gguf_file}"]
    if template is None:
        lines.append(
            "# no TEMPLATE: this checkpoint's chat template is not ERNIE 4.5's default, which is the one "
            "erniekit translates to Ollama's syntax; write a TEMPLATE for it"
        )
    else:
        if '"""' in template:
            raise ValueError('the chat template contains """, which a Modelfile TEMPLATE cannot hold')
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f'PARAMETER stop "{s}"' for s in dict.fromkeys(stops)]
    lines += [f"PARAMETER {k} {v}" for k, v in params.items()]
    return "\n".join(lines) + "\n"
