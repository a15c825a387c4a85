"""`erniekit chat`: one-shot or interactive chat with a checkpoint, streamed token by token.

Prompts are tokenized the way SFT trains them (erniekit.data.encode): each rendered chunk of
the chat template (the prompt up to "Assistant: ", then the reply plus its sep token) is
encoded on its own, so a multi-turn history gives the model the ids it was trained on.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from erniekit.errors import CheckpointError, ErniekitError
from erniekit.infer.detokenize import TextStream
from erniekit.infer.stops import decodable_vocab, stop_ids  # noqa: F401 - stop_ids: where chat, server and WebUI take it from
from erniekit.utils.text import is_text

if TYPE_CHECKING:  # paddle is imported only when chat runs
    from erniekit.infer.generate import SamplingParams
    from erniekit.models.ernie4_5 import Ernie4_5ForCausalLM
    from erniekit.models.ernie4_5.tokenizer import ErnieTokenizer

CLEAR, EXIT = "/clear", ("/exit", "/quit")
MAX_TOOL_ROUNDS = 5  # model replies per user message when --tools functions keep being called
MAX_CALLS_PER_REPLY = 16  # calls of one reply that run; the model is told the others did not


def load_chat_model(model_dir: str) -> tuple[Ernie4_5ForCausalLM, ErnieTokenizer]:
    """Model + tokenizer from one checkpoint directory; a missing piece is a one-line error."""
    from erniekit.models.registry import load_model_or_adapter, load_tokenizer, tokenizer_dir

    if not os.path.isdir(model_dir):
        raise CheckpointError(
            f"{model_dir}: checkpoint directory not found; pass a directory written by "
            "'erniekit train' or a Hugging Face ERNIE-4.5 checkpoint"
        )
    tok_dir = tokenizer_dir(model_dir)  # an adapter saved without a tokenizer uses its base's
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.model")):
        raise CheckpointError(
            f"{tok_dir}: no tokenizer files (tokenizer.model); chat needs the tokenizer "
            "saved next to the weights: copy it from the original checkpoint"
        )
    tokenizer = load_tokenizer(model_dir)
    model = load_model_or_adapter(model_dir)
    model.eval()
    return model, tokenizer


def chat_prompt_ids(
    tokenizer: ErnieTokenizer, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """Ids of a whole conversation plus the generation prompt, encoded chunk by chunk as SFT and
    `ChatSession` encode it (each user turn's prompt, then each reply with its sep token)."""
    text, ids = "", []

    def extend(rendered: str) -> None:
        nonlocal text, ids
        ids = ids + tokenizer.encode(rendered[len(text) :]) if rendered.startswith(text) else tokenizer.encode(rendered)
        text = rendered

    def render(msgs: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tools=tools, **template_kwargs)

    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            extend(render(messages[:k], True))
            extend(render(messages[: k + 1], False))
    extend(render(messages, True))
    return ids


class ChatSession:
    """A conversation: the messages list plus the token ids its rendering has been encoded to."""

    def __init__(
        self,
        model: Ernie4_5ForCausalLM | None,
        tokenizer: ErnieTokenizer,
        params: SamplingParams,
        system: str | None = None,
        out: TextIO | None = None,
        speculative: bool = False,
        tools: list[dict] | None = None,
        functions: dict | None = None,
        rerank: int = 1,
        head=None,
    ):
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.rerank, self.head = rerank, head  # --rerank N: N sampled answers, the most credible kept
        self.tools = tools or None  # tool schemas the model sees (--tools)
        self.functions = functions or {}  # name -> Python function run when the model calls it
        self.thinking = bool(getattr(tokenizer, "thinking", False))  # replies carry reasoning / tool calls
        if rerank > 1 and self.thinking:  # it would be ignored: the thinking turn streams one reply
            raise CheckpointError(
                "chat: --rerank scores plain replies; this checkpoint writes thinking-format replies "
                "(reasoning, tool calls) that the credibility head does not score: drop --rerank"
            )
        self.speculative = speculative  # greedy self-speculative decoding with the MTP heads (docs/mtp.md)
        self.system = system
        self.out = out
        self.images: list[str] = []  # images of the first user message (a vision-language model)
        self.videos: list = []  # its videos, after the images: decoded (frames, times)
        self.clear()

    def clear(self) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self._text = ""  # rendered text covered by self._ids
        self._ids: list[int] = []

    def _extend(self, rendered: str) -> list[int]:
        """Ids of `rendered`, encoding only what was added since the last call (as training does)."""
        if rendered.startswith(self._text):
            self._ids = self._ids + self.tokenizer.encode(rendered[len(self._text) :])
        else:  # a template whose output is not a growing prefix: encode it whole
            self._ids = self.tokenizer.encode(rendered)
        self._text = rendered
        return self._ids

    def prompt_ids(self) -> list[int]:
        """Ids of the whole history with the generation prompt ("Assistant: ") appended."""
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tools=self.tools)
        return list(self._extend(rendered))

    def _reply_with_images(self, user: str) -> str:
        """The greedy answer of a vision-language model: the whole history re-rendered with the
        images before the first user message (erniekit/infer/vl_generate.py)."""
        from erniekit.data.formats import IMAGE_MARKER, VIDEO_MARKER, Conversation
        from erniekit.infer.vl_generate import answer

        body = [m for m in self.messages if m["role"] != "system"] + [{"role": "user", "content": user}]
        pairs = [(body[i]["content"], body[i + 1]["content"]) for i in range(0, len(body) - 1, 2)]
        first = pairs[0][0] if pairs else user
        turns = pairs + [(user, "")]
        turns[0] = (IMAGE_MARKER * len(self.images) + VIDEO_MARKER * len(self.videos) + first, turns[0][1])
        conv = Conversation(self.system, turns, [True] * len(turns), "chat", list(self.images), list(self.videos))
        text = answer(self.model, self.tokenizer, conv, self.model.image_settings, self.params.max_new_tokens)
        self._write(text)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        return text

    def reply(self, user: str) -> str:
        """Add a user turn, stream the assistant's answer to `out`, keep it in the history; a turn
        that fails (an overlong history, text that is not Unicode) leaves the history as it was."""
        saved = (list(self.messages), self._text, self._ids)
        try:
            return self._reply(user)
        except ErniekitError:
            self.messages, self._text, self._ids = saved
            raise

    def _reply(self, user: str) -> str:
        if self.images or self.videos:
            return self._reply_with_images(user)
        self.messages.append({"role": "user", "content": user})
        if not self.thinking:
            text = self._reranked() if self.rerank > 1 else self._generate(None)
            self.messages.append({"role": "assistant", "content": text})
            self._remember()
            return text
        for _ in range(MAX_TOOL_ROUNDS):
            reply = self._thinking_turn()
            if not reply.tool_calls or not self.functions:
                return reply.content
            from erniekit.infer.local_tools import call_tool

            for k, call in enumerate(reply.tool_calls):
                if k < MAX_CALLS_PER_REPLY:
                    result = call_tool(self.functions, call["function"]["name"], call["function"]["arguments"])
                else:
                    result = f"error: not run; at most {MAX_CALLS_PER_REPLY} tool calls of one reply run"
                self._write(f"[tool result] {result}\n")
                self.messages.append({"role": "tool", "content": result, "tool_call_id": call["id"]})
        self._write(f"(stopped after {MAX_TOOL_ROUNDS} rounds of tool calls)\n")
        return ""

    def _thinking_turn(self):
        """One reply of a thinking-format model: reasoning shown as `[thinking] ...`, the answer as
        text, each tool call as `[tool call] name(arguments)`."""
        import json

        from erniekit.infer.reply_parser import ReplyParser, collect

        parser, events, shown = ReplyParser(thinking_open=True), [], {"kind": None}

        def show(new_events) -> None:
            for kind, value in new_events:
                if kind == "tool_call":
                    fn = value["function"]
                    self._write(("\n" if shown["kind"] else "") + f"[tool call] {fn['name']}({fn['arguments']})\n")
                    shown["kind"] = None
                    continue
                if kind != shown["kind"]:
                    self._write(("\n" if shown["kind"] else "") + ("[thinking] " if kind == "reasoning" else ""))
                    shown["kind"] = kind
                self._write(value)
            events.extend(new_events)

        self._generate(lambda piece: show(parser.feed(piece)))
        show(parser.finish())
        reply = collect(events)
        message = {"role": "assistant", "content": reply.content or None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                }
                for c in reply.tool_calls
            ]
        elif not reply.content:
            message["content"] = ""
        self.messages.append(message)
        self._remember()
        return reply

    def _reranked(self) -> str:
        """Sample `rerank` answers side by side and write the one the credibility head scores highest
        (erniekit/infer/credibility.py); not streamed: the choice needs every whole answer."""
        from erniekit.infer.credibility import rerank, sample_replies

        ids = self.prompt_ids()
        p = self._within_context(ids)
        answers = sample_replies(
            self.model,
            self.tokenizer,
            [ids] * self.rerank,
            p.temperature,
            p.max_new_tokens,
            self.rerank,
            p.seed,
            p.top_p,
        )
        best, _ = rerank(self.model, self.head, self.tokenizer, self.messages, answers)
        if not answers[best].strip():  # rerank keeps a blank only when all are: say so, not a silent blank
            self._write(
                f"(all {len(answers)} sampled answers were empty: the model ended each reply at once; "
                "ask again, or raise --rerank or --temperature)"
            )
            return ""
        self._write(answers[best])
        return answers[best]

    def _within_context(self, ids: list[int]) -> SamplingParams:
        """The sampling parameters with max_new_tokens capped at what the model's context leaves
        after the prompt; an error when the prompt alone fills it."""
        if self.model is None:  # a session driven by a stand-in generator (tests)
            return self.params
        context = int(self.model.config.max_position_embeddings)
        room = context - len(ids)
        if room < 1:
            raise ErniekitError(
                f"chat: the conversation is {len(ids)} tokens, the model's context is {context}; "
                f"start over ({CLEAR} in a session) or send a shorter message"
            )
        return replace(self.params, max_new_tokens=min(self.params.max_new_tokens, room))

    def _remember(self) -> None:
        # the reply chunk as training encodes it, so the next turn reuses these ids
        self._extend(self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=False, tools=self.tools))

    def _generate(self, on_text) -> str:
        """Generate one reply from the history; stream its text to `out` (or to `on_text`)."""
        from erniekit.infer.generate import generate_stream

        stream = generate_stream
        if self.speculative:  # same tokens as greedy generate_stream, fewer trunk forwards
            from erniekit.infer.speculative import speculative_stream as stream
        ids = self.prompt_ids()
        params = self._within_context(ids)
        stops = set(params.stop_token_ids)
        text = TextStream(self.tokenizer)
        write = on_text or self._write
        vocab = decodable_vocab(self.model, self.tokenizer)
        for step in stream(self.model, [ids], params, pad_id=self.tokenizer.pad_token_id or 0, vocab=vocab):
            tok = int(step[0])
            if tok < 0 or tok in stops:
                break
            self._emit(text, tok, write)
        write(text.pending)
        return text.text()

    def _emit(self, text: TextStream, tok: int, write) -> None:
        """Print the text token `tok` makes certain (an incomplete multi-byte character, whose
        byte-fallback pieces are still to come, waits for them), decoding a few tokens, not the
        whole reply (erniekit/infer/detokenize.py)."""
        piece = text.push(tok)
        if piece:
            write(piece)

    def _write(self, s: str) -> None:
        if s and self.out is not None:
            self.out.write(s)
            self.out.flush()


def pack_for_chat(model, mode: str) -> str:
    """Pack the weights as the server does (erniekit/infer/weight_packing.py): one chat keeps one
    model for many decode steps. The choice in words."""
    from erniekit.infer.weight_packing import packing_choice
    from erniekit.nn import small_gemm

    pack, packing = packing_choice(model, mode)
    if pack:
        small_gemm.pack_weights(model)
    return packing


def run_chat(args: Any) -> int:
    """Entry of `erniekit chat` (args from cli._chat_parser): one-shot with --prompt, else a REPL."""
    from erniekit.infer.generate import SamplingParams

    tools, functions = None, None
    if getattr(args, "tools", None):  # a broken tools file is one line before the model loads
        from erniekit.infer.local_tools import load_tools

        tools, functions = load_tools(args.tools)
    model, tokenizer = load_chat_model(args.model_dir)
    packing = pack_for_chat(model, getattr(args, "packed_weights", None) or "auto")
    rerank, head = getattr(args, "rerank", 1), None
    if rerank > 1:
        from erniekit.nn.credibility import CREDIBILITY_HEAD_NAME, load_credibility_head

        head = load_credibility_head(args.model_dir, model.config.hidden_size)
        if head is None:
            raise CheckpointError(
                f"{args.model_dir}: --rerank needs the credibility head ({CREDIBILITY_HEAD_NAME}) next to the "
                "weights: train with credibility_loss_weight > 0 (docs/control.md)"
            )
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop_token_ids=stop_ids(model, tokenizer),
        seed=args.seed,
    )
    speculative = bool(getattr(args, "speculative", False))
    if speculative:
        from erniekit.infer.speculative import check_speculative

        check_speculative(model, params)
    if tools and not getattr(tokenizer, "thinking", False):
        raise CheckpointError(
            f"{args.model_dir}: --tools needs a checkpoint in the ERNIE thinking format (trained with "
            "chat_template: ernie_thinking); this one's chat template has no tool calls"
        )
    from erniekit.data.control import control_system

    session = ChatSession(
        model,
        tokenizer,
        params,
        system=control_system(args.system, getattr(args, "control", None) or {}),  # --control: docs/control.md
        out=sys.stdout,
        speculative=speculative,
        tools=tools,
        functions=functions,
        rerank=rerank,
        head=head,
    )
    if getattr(args, "image", None) or getattr(args, "video", None):
        from erniekit.models.ernie4_5_vl.processor import load_image
        from erniekit.models.ernie4_5_vl.video import load_video

        if not hasattr(model, "visual_features"):
            raise CheckpointError(
                f"{args.model_dir}: --image / --video need a vision-language (ERNIE-4.5-VL) checkpoint"
            )
        for i, path in enumerate(args.image):
            load_image(path, where=f"--image {i + 1}")  # a bad file is one line now, not mid-reply
        session.images = list(args.image)
        # decoded once here (a bad file is one line now), kept as (frames, times)
        session.videos = [load_video(p, f"--video {i + 1}", model.video_settings) for i, p in enumerate(args.video)]
    if args.prompt is not None:
        session.reply(args.prompt)
        print(flush=True)
        return 0
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused below, not a traceback here
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        print(
            f"chatting with {args.model_dir}; {packing}; {CLEAR} resets the history, {EXIT[0]} or Ctrl-D quits",
            flush=True,
        )
    while True:
        try:
            line = input("User: ")
        except EOFError:
            print()
            return 0
        if not is_text(line):  # bytes that were not UTF-8 (stdin reads them as surrogate escapes)
            print("error: that line is not UTF-8 text; type it again", file=sys.stderr, flush=True)
            continue
        if not interactive:  # a piped line is not echoed: write it so the transcript reads as a dialogue
            print(line, flush=True)
        line = line.strip()
        if not line:
            continue
        if line in EXIT:
            return 0
        if line == CLEAR:
            session.clear()
            print("(history cleared)", flush=True)
            continue
        sys.stdout.write("Assistant: ")
        try:
            session.reply(line)
        except ErniekitError as e:  # this turn is dropped; the session goes on
            print(f"\nerror: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
