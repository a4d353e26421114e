"""distill7: the prompts of distill 3-6 again, to be answered by sampling (temperature 0.7)
instead of greedily. A sampled answer is new text from the target's own distribution (it leaves
the greedy answer within a few tokens), so it is more self-distillation data without writing more
prompts; the drafters learn the target's distribution either way (soft labels). Ids keep the
source set and line ("d5-17": distill5's file, line 17), so a resumed run skips what is done.

Reads: the prompts of distill 3-6.

(Was training/make-prompts7.)"""
from .common import jsonl_file, read_prompt_records

SOURCES = ["distill3", "distill4", "distill5", "distill6"]


def generate(ctx):
    out = []
    for s in SOURCES:
        tag = s.replace("distill", "d")
        records = read_prompt_records(ctx.read(s), ctx.prompts_path(s).suffix == ".jsonl")
        out += [{"question_id": f"{tag}-{n}", "category": "resampled", "turns": turns} for n, turns in records]
    return jsonl_file(out, ensure_ascii=False)
