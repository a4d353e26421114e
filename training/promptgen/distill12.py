"""distill12: two-turn conversations whose first turn SmolLM2 wrote itself (Magpie's method, as
distill11: `selfspec distill --self-prompts`, with other seeds), and whose second turn is a
follow-up from distill10's list (written here), so the answers include a second turn that reads
the first turn's answer, as chat benchmarks' second turns do.

Why: distill11 (self-written prompts, one turn) raised the draft layer's accuracy on the bundled
eval prompts most of any set (recipes/smollm2.md, the fifth epoch); its first guess is still
right less often on the eval prompts than on the corpus, and more of this kind is what still
moves τ (the τ-against-data table there). A second turn doubles the answers per prompt written.

The raw file (committed: prompts/self12-written.jsonl, every prompt the target wrote, finished or
not) was made on the 2-core Xeon on 7 December 2026 with

  selfspec distill --model models/smollm2.gguf --weights native --self-prompts 6000 \\
    --temperature 1 --top-p 0.95 --max-tokens 96 --batch 16 --seed 1200000 \\
    --out training/prompts/self12-written.jsonl

(prompt n is sampled with seed 1200000 + n, so no prompt repeats distill11's seeds). This module
keeps, in n order, what distill11 keeps (finished prompts of 20-600 printable characters without
chat-template tokens, none touching the eval or tune prompts' topics, none repeating an earlier
set's prompt) and gives each a follow-up drawn with a fixed seed.

Reads: prompts/self12-written.jsonl, the eval and tune prompts, the prompts of distill 1-11."""
import pathlib
import random

from .common import BANNED_WIDER, jsonl_file, keep
from .distill10 import FOLLOW
from .distill11 import finished

WRITTEN = pathlib.Path(__file__).resolve().parent.parent / "prompts" / "self12-written.jsonl"


def generate(ctx):
    ids = finished(WRITTEN, "distill12")
    prompts = keep(list(ids), BANNED_WIDER, ctx.held_out(),
                   ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5", "distill6", "distill7", "distill8",
                             "distill9", "distill10", "distill11"]))
    rng = random.Random(12)
    return jsonl_file(({"question_id": ids[p], "category": "self", "turns": [p, rng.choice(FOLLOW)]} for p in prompts),
                      ensure_ascii=False)
