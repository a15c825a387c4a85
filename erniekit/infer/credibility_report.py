"""`erniekit eval MODEL_DIR --credibility --data PATH`: the credibility report of a checkpoint
(erniekit/infer/credibility.py) over a dataset, printed and written to credibility.json."""

from __future__ import annotations

from erniekit.infer.credibility import DEFAULT_TEMPERATURE, credibility_report

REPORT_NAME = "credibility.json"


def run_credibility_report(
    model_dir: str,
    data: str,
    out_dir: str,
    max_samples: int,
    batch_size: int,
    max_new_tokens: int,
    temperature: float = DEFAULT_TEMPERATURE,
    seed: int = 0,
) -> dict:
    """`erniekit eval MODEL_DIR --credibility --data PATH`: the report over the first `max_samples`
    conversations of `data`, written to OUT_DIR/credibility.json."""
    import os

    from erniekit.data.formats import load_sft_examples
    from erniekit.errors import CheckpointError, DataError
    from erniekit.infer.chat import load_chat_model
    from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, load_credibility_head
    from erniekit.utils.io import atomic_write_json

    convs = [c for c in load_sft_examples(data) if c.dialog is None][:max_samples]  # before the model loads
    if not convs:
        raise DataError(
            f"--data {data}: no plain conversations to score (tool dialogs are not scored); "
            "pass SFT records without tools or tool calls"
        )
    from erniekit.data.control import CONTROL_RECORD_NAME, check_conversation_controls, read_control_record

    record = read_control_record(model_dir)  # the data's controls, before the weights load (docs/control.md)
    check_conversation_controls(convs, record, f"--data {data}", os.path.join(model_dir, CONTROL_RECORD_NAME))
    model, tokenizer = load_chat_model(model_dir)
    head = load_credibility_head(model_dir, model.config.hidden_size)
    if head is None:
        raise CheckpointError(
            f"{model_dir}: no {CREDIBILITY_HEAD_NAME}; train with credibility_loss_weight > 0 (docs/control.md)"
        )
    rep = credibility_report(model, head, tokenizer, convs, batch_size, max_new_tokens, temperature, seed)
    rep = {"model": model_dir, "data": data, **rep}
    rep["path"] = os.path.join(out_dir, REPORT_NAME)
    atomic_write_json(rep["path"], rep)
    return rep


def format_credibility(rep: dict) -> str:
    """The report as a few aligned lines: probability of "real" on each side, then the AUC."""
    lines = [f"{'replies':<10} {'n':>5} {'mean':>7} {'p10':>7} {'median':>7} {'p90':>7}"]
    for side in ("real", "generated"):
        s = rep[side]
        if s["n"]:
            lines.append(
                f"{side:<10} {s['n']:>5} {s['mean']:>7.3f} {s['p10']:>7.3f} {s['median']:>7.3f} {s['p90']:>7.3f}"
            )
        else:
            lines.append(f"{side:<10} {0:>5}")
    lines.append(
        f"ROC AUC (real vs generated): {rep['auc']:.3f}; {rep['identical']} of {rep['examples']} sampled replies equal "
        f"the real one (left out); temperature {rep['temperature']}, seed {rep['seed']}"
    )
    return "\n".join(lines)
