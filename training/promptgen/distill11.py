"""distill11: prompts SmolLM2 wrote itself. `selfspec distill --self-prompts` samples a user's
message after the chat template's opening of a user turn (system prompt, then the user header),
as Magpie does: requests from the target's own idea of what users ask, on whatever subjects and in
whatever styles its sampling reaches, written by no person here and taken from no benchmark.

Why: distill 1-10 are templates filled from lists written here and text on this machine; the draft
layer's first guess is right 53-58% of the time on their held-out prompts but 41-45% on the bundled
eval prompts, which were written separately in other styles. Prompts from the target's own
distribution are a source of variety no list written here has.

The raw file (committed: prompts/self11-written.jsonl, every prompt the target wrote, finished or
not) was made on the 2-core Xeon on 7 December 2026 (rewritten by `177e980`'s code, which ends
a prompt at a stray special token: three unfinished lines changed, no finished one) with

  selfspec distill --model models/smollm2.gguf --weights native --self-prompts 5000 \\
    --temperature 1 --top-p 0.95 --max-tokens 96 --batch 16 --seed 1100000 \\
    --out training/prompts/self11-written.jsonl

(prompt n is sampled with seed 1100000 + n, so each line is the same at any batch size and after
any resume; the command leaves the file in prompt order). This module keeps, in n order: finished prompts of
20-600 characters, printable text without chat-template tokens, dropping the eval and tune
prompts' topics (BANNED_WIDER, as every set since distill6), their text, duplicates and every
earlier set's prompts.

Reads: prompts/self11-written.jsonl (the target's own prompts), the eval and tune prompts, and the
prompts of distill 1-10."""
import json
import pathlib

from .common import BANNED_WIDER, SourceMissing, jsonl_file, keep

WRITTEN = pathlib.Path(__file__).resolve().parent.parent / "prompts" / "self11-written.jsonl"


def usable(p):
    return (20 <= len(p) <= 600 and "<|" not in p and "|>" not in p
            and all(c.isprintable() or c in "\n\t" for c in p))


def finished(written, module):
    """The usable finished prompts of a `distill --self-prompts` file, in prompt order, each with
    its first question_id. Lines end at "\n" only: a prompt may hold U+2028, which splitlines()
    would split at."""
    if not written.exists():
        raise SourceMissing(f"{written}: the target's own prompts (the selfspec distill --self-prompts command in "
                            f"training/promptgen/{module}.py)")
    recs = [json.loads(l) for l in written.read_text(encoding="utf-8").split("\n") if l.strip()]
    recs.sort(key=lambda r: int(r["question_id"].split("-")[1]))
    ids = {}
    for r in recs:
        p = r["prompt"].strip()
        if r["finished"] and usable(p):
            ids.setdefault(p, r["question_id"])
    return ids


def generate(ctx):
    ids = finished(WRITTEN, "distill11")
    prompts = keep(list(ids), BANNED_WIDER, ctx.held_out(),
                   ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5", "distill6", "distill7", "distill8",
                             "distill9", "distill10"]))
    return jsonl_file(({"question_id": ids[p], "category": "self", "prompt": p} for p in prompts), ensure_ascii=False)
