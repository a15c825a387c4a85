#!/usr/bin/env python
"""Train the small ERNIE-style sentencepiece tokenizer shipped in erniekit/resources/tokenizer.

Deterministic: the corpus is generated here (synthetic arithmetic from erniekit.data.synthetic
plus the English lines below), sentencepiece runs single-threaded without sampling, so the
same command writes the same tokenizer.model bytes.

Layout follows the real ERNIE 4.5 tokenizer: <unk>=0 (also the pad token), <s>=1, </s>=2,
then the ERNIE control tokens as user-defined pieces, byte fallback so any text encodes,
each digit its own token, no text normalisation and no dummy prefix (decode(encode(x)) == x).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sentencepiece as spm  # noqa: E402

from erniekit.data.synthetic import make_arithmetic  # noqa: E402
from erniekit.models.ernie4_5.tokenizer import (  # noqa: E402
    DEFAULT_ADDITIONAL_SPECIAL_TOKENS,
    DEFAULT_SPECIAL_TOKENS,
    RESOURCE_DIR,
    ErnieTokenizer,
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog.
A journey of a thousand miles begins with a single step.
Water boils at one hundred degrees Celsius at sea level.
The sun rises in the east and sets in the west.
She opened the window and let the cool morning air into the room.
Please add the two numbers and write the answer after the equals sign.
What is the capital of France? The capital of France is Paris.
How are you today? I am fine, thank you for asking.
Can you help me with my homework? Of course, what do you need?
The model reads the question and writes a short answer.
Training a language model needs data, a loss function and an optimizer.
The learning rate controls how large each update step is.
A tokenizer splits text into pieces and maps each piece to a number.
Every sentence in this file is plain English written for the tokenizer.
Mixture of experts layers route each token to a few experts.
The router picks the top two experts for every token.
Attention lets each position look at earlier positions in the sequence.
Rotary position embeddings rotate queries and keys by an angle.
Checkpoints are saved so that an interrupted run can resume.
The evaluation set is held out and never used for training.
Exact match compares the predicted answer with the reference answer.
You are a helpful assistant that answers arithmetic questions.
You are a careful assistant. Answer with the number only.
Explain your reasoning step by step, then give the final answer.
The cat sat on the mat and looked out at the rain.
My favourite colours are blue, green and yellow.
It was a bright cold day in April, and the clocks were striking thirteen.
The library opens at nine in the morning and closes at six in the evening.
He bought three apples, two oranges and a loaf of bread.
They walked along the river until the path turned into the forest.
Music can make a long drive feel much shorter.
The meeting has been moved to Thursday afternoon.
Remember to drink water and take short breaks while working.
The recipe calls for flour, sugar, butter, eggs and a pinch of salt.
Mountains, rivers, lakes and forests cover most of the country.
The train leaves the station at a quarter past eight.
Children learn to count before they learn to add and subtract.
Addition, subtraction, multiplication and division are the four basic operations.
The sum of two even numbers is always even.
A negative number is smaller than zero.
If you subtract a larger number from a smaller one, the result is negative.
The answer is correct. Well done!
That answer is wrong; please try again.
Let us check the result once more before we continue.
Thank you! Have a nice day.
Good morning, everyone. Today we will talk about language models.
The weather today is sunny with a light breeze from the north.
Reading books is a good way to learn new words.
Science asks questions and tests the answers with experiments.
Computers store numbers as bits, and each bit is either zero or one.
A function takes some input and returns an output.
Python is a popular programming language for machine learning.
PaddlePaddle is a deep learning framework developed by Baidu.
ERNIE is a family of large language models.
The server returns a JSON response with the generated text.
Errors should say what went wrong, where it happened and what to do next.
Keep the code small, clear and easy to read.
Write tests that fail when the feature breaks.
The old man and the sea is a short novel about a fisherman.
Once upon a time there was a little village near a big forest.
The village had a baker, a blacksmith and a small school.
Every morning the baker made fresh bread for the whole village.
One day a stranger arrived with a heavy bag on his back.
Nobody knew where he came from or where he was going.
The stranger asked for a glass of water and a place to sleep.
The children were curious and followed him down the street.
At night the stars were bright and the wind was quiet.
In the morning the stranger was gone, but he left a gift behind.
Inside the bag were books, maps and a wooden box full of coins.
The village used the coins to build a new bridge over the river.
Why is the sky blue? Sunlight scatters off the air, and blue light scatters the most.
How many days are there in a week? There are seven days in a week.
How many hours are there in a day? There are twenty-four hours in a day.
What is two plus two? Two plus two is four.
What is ten minus three? Ten minus three is seven.
Which is larger, nine or twelve? Twelve is larger than nine.
Name three fruits. Apples, bananas and cherries.
Translate "hello" into French. The French word is "bonjour".
Summarise the text in one sentence.
Give a short title for this paragraph.
List the steps needed to make a cup of tea.
First boil the water, then pour it over the tea leaves and wait three minutes.
The café on the corner serves coffee, tea and fresh pastries.
Naïve approaches often work well as a first baseline.
The résumé lists her education, experience and skills.
Prices rose by 5% last year, and wages rose by 3%.
Call me at 555-0123 or send an email to info@example.com.
The file is stored at /home/user/data/train.jsonl on the server.
Use the --help flag to see all command line options.
Set max_seq_len=512 and learning_rate=0.0003 in the config file.
The loss fell from 4.2 to 1.3 after 200 steps.
Batch size 8, sequence length 256, two CPU cores.
"""

SUBJECTS = [
    "The teacher",
    "My friend",
    "A student",
    "The doctor",
    "Our team",
    "The farmer",
    "The engineer",
    "A little girl",
    "The old sailor",
    "The assistant",
]
VERBS = ["reads", "writes", "finds", "checks", "builds", "explains", "counts", "solves", "shares", "remembers"]
OBJECTS = [
    "a long letter",
    "the answer",
    "three new words",
    "a simple plan",
    "the small boat",
    "every question",
    "the number twelve",
    "a short story",
    "the missing key",
    "a better way",
]
ENDINGS = [
    "before lunch.",
    "in the evening.",
    "every day.",
    "with great care.",
    "at the library.",
    "without any help.",
    "for the whole class.",
    "after the storm.",
    "on Monday.",
    "very quickly.",
]


def english_lines() -> list[str]:
    """Handwritten lines plus 300 template sentences (fixed, no randomness)."""
    lines = [line for line in ENGLISH.splitlines() if line.strip()]
    for i in range(300):
        lines.append(
            f"{SUBJECTS[i % 10]} {VERBS[(i // 10) % 10]} {OBJECTS[(i * 7) % 10]} {ENDINGS[(i * 3 + i // 10) % 10]}"
        )
    return lines


def corpus(seed: int) -> list[str]:
    """Training sentences: English, chat-shaped lines and arithmetic text."""
    rows = make_arithmetic(4000, seed, min_digits=1, max_digits=4, ops=("+", "-", "*"))
    cls, sep = DEFAULT_SPECIAL_TOKENS["cls_token"], DEFAULT_SPECIAL_TOKENS["sep_token"]
    # sentencepiece trains on single lines, so chat turns appear as the lines they start
    chat = [line for r in rows[:1000] for line in (f"{cls}User: {r['src'][0]}", f"Assistant: {r['tgt'][0]}{sep}")]
    math = [r["src"][0] + r["tgt"][0] for r in rows[1000:]]
    english = english_lines()
    dialog = [line for e in english[:80] for line in (f"User: {e}", f"Assistant: {e}{sep}")]
    return english * 3 + chat + math + dialog


def train(out_dir: str, vocab_size: int, seed: int) -> ErnieTokenizer:
    """Train sentencepiece BPE in memory and save the tokenizer directory."""
    model = _BytesWriter()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,  # ERNIE pads with <unk> (id 0)
        unk_piece=DEFAULT_SPECIAL_TOKENS["unk_token"],
        bos_piece=DEFAULT_SPECIAL_TOKENS["bos_token"],
        eos_piece=DEFAULT_SPECIAL_TOKENS["eos_token"],
        user_defined_symbols=[DEFAULT_SPECIAL_TOKENS["cls_token"], DEFAULT_SPECIAL_TOKENS["sep_token"]]
        + DEFAULT_ADDITIONAL_SPECIAL_TOKENS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        minloglevel=2,
    )
    tok = ErnieTokenizer(model.data)
    tok.save_pretrained(out_dir)
    return tok


class _BytesWriter:
    """Minimal file-like sink for SentencePieceTrainer(model_writer=...)."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESOURCE_DIR, help="output directory (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="sentencepiece vocab size (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic arithmetic corpus (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    tok = train(args.out, args.vocab_size, args.seed)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in tok.special_tokens.items()}
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: vocab_size={tok.vocab_size} special ids={ids} ({size} bytes)")


if __name__ == "__main__":
    main()
