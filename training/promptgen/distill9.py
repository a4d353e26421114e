"""distill9: two-turn conversations for self-distillation. The first turn comes from what distill8
left unused in the same sources (Python standard-library functions, paragraphs of four Rust books,
Rust compiler error codes; read from the running Python 3.11 and the Rust toolchain docs) plus
Rust standard-library items distill6 did not sample, and distill8's topic lists under the
templates it did not draw; the second turn is a follow-up request written here ("make it
shorter", "give another example", ...), which the target answers after its own first answer, as a
chat user would see it. Both answers are training text. Deterministic (seed 9); eval and tune
prompt topics are dropped, and no first turn repeats a prompt of distill 1-8.

Reads: what distill8 reads (distill8.build: the same pools, drawn in the same order), the Rust
toolchain's HTML docs, the eval and tune prompts, the prompts of distill 1-8.

(Was training/make-prompts9, which exec'd make-prompts8's source cut at a literal string to
rebuild those pools; distill8.build returns them.)"""
import random

from . import distill8
from .common import jsonl_file, keep, rust_std_items

FOLLOW = ["Can you give me another example?", "Make it shorter.", "Explain that to a ten-year-old.",
          "Can you summarise that in one sentence?", "Thanks! What else should I know?", "Can you turn that into a list?",
          "Why is that?", "Give me a real-world example.", "What are common mistakes people make with this?",
          "Can you rewrite that more formally?", "Can you explain the second point in more detail?",
          "How would I test that?", "Is there a simpler way?", "What would you do differently for a beginner?"]


def generate(ctx):
    ns = distill8.build(ctx)
    rng = random.Random(9)
    firsts = []
    used = set(ns.prompts)
    funcs = [f for f in ns.funcs if not any(f"`{f[0]}`" in p for p in used)]
    for x, kind in rng.sample(funcs, min(200, len(funcs))):
        firsts.append(rng.choice(ns.tpl_py[kind]).format(x=x))
    paras = [p for p in ns.paras if not any(p in q for q in used)]
    firsts += [rng.choice(ns.tpl_para).format(p=p) for p in rng.sample(paras, min(420, len(paras)))]
    codes = [c for c in ns.codes if not any(c in q for q in used)]
    firsts += [rng.choice(ns.tpl_code).format(x=c) for c in rng.sample(codes, min(160, len(codes)))]

    # Rust standard-library items (as distill6 lists them), with templates it did not use.
    items = {x for _, x in rust_std_items()}
    tpl_item = ["When would I use `{x}` in Rust?", "Show me a small Rust program that uses `{x}`.", "What is `{x}` for in Rust, in two sentences?"]
    firsts += [rng.choice(tpl_item).format(x=x) for x in rng.sample(sorted(items), min(300, len(items)))]

    # distill8's general topic lists under the templates it did not draw for them.
    for xs, tpl in [("concepts", "tpl_con"), ("places", "tpl_place"), ("animals", "tpl_animal"), ("jobs", "tpl_job"), ("tips", "tpl_tip")]:
        for x in getattr(ns, xs):
            firsts += [t.format(x=x) for t in getattr(ns, tpl) if t.format(x=x) not in used]
    for a, b in ns.pairs:
        firsts += [t.format(a=a, b=b) for t in ns.tpl_cmp if t.format(a=a, b=b) not in used]

    seen = used | ctx.seen(["distill", "distill2", "distill3", "distill4", "distill5", "distill6", "distill7", "distill8"])
    firsts = keep(firsts, ns.banned, ctx.held_out(), seen)
    rng.shuffle(firsts)
    return jsonl_file({"turns": [p, rng.choice(FOLLOW)]} for p in firsts)
