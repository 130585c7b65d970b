"""Properties of `fix` over generated accumulation loops: the output compiles, keeps every
comment and line ending, is a fixed point, and no longer shows the findings it fixed."""

from __future__ import annotations

import io
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gaaudit.checks.engine import check_file
from gaaudit.config import Settings
from gaaudit.findings import Confidence
from gaaudit.fixes.fixer import fix_source

ALL = Settings(min_confidence=Confidence.LOW)
SOURCES = ("model", "model-inline", "cross-entropy", "criterion")
FORMS = ("divide", "divide-in-place", "divide-at-backward", "scaler", "no-division")
WINDOWS = ("modulo", "micro-loop")


@dataclass(frozen=True)
class Shape:
    """One accumulation loop, before names, comments and layout are chosen."""

    source: str
    form: str
    window: str
    padding: bool
    loss: str = "loss"
    divisor: str = "accum_steps"
    step: str = "step"
    batch: str = "batch"


def lines(shape: Shape) -> list[tuple[int, str]]:
    """(indentation level, statement) of the whole file."""
    loss, k, batch = shape.loss, shape.divisor, shape.batch
    out = [
        (0, "import torch"),
        (0, "import torch.nn as nn"),
        (0, "import torch.nn.functional as F"),
    ]
    if shape.source.startswith("model"):
        out += [
            (0, "from transformers import AutoModelForCausalLM"),
            (0, 'model = AutoModelForCausalLM.from_pretrained("gpt2")'),
        ]
    else:
        out.append((0, "model = build_model()"))
    if shape.source == "criterion":
        out.append((0, "criterion = nn.CrossEntropyLoss()"))
    if shape.form == "scaler":
        out.append((0, "scaler = torch.cuda.amp.GradScaler()"))
    if shape.padding:
        out.append((0, "collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)"))
    if shape.window == "modulo":
        out.append((0, f"for {shape.step}, {batch} in enumerate(loader):"))
        body = 1
    else:
        out += [
            (0, "for update in range(max_updates):"),
            (1, f"for micro_step in range({k}):"),
            (2, f"{batch} = next(batches)"),
        ]
        body = 2
    logits, labels = "logits.view(-1, logits.size(-1))", f'{batch}["labels"].view(-1)'
    mean = {
        "model": "outputs.loss",
        "model-inline": f"model(**{batch}).loss",
        "cross-entropy": f"F.cross_entropy({logits}, {labels}, ignore_index=-100)",
        "criterion": f"criterion({logits}, {labels})",
    }[shape.source]
    if shape.source == "model":
        out.append((body, f"outputs = model(**{batch})"))
    elif shape.source != "model-inline":
        out.append((body, f'logits = model({batch}["input_ids"])'))
    out += {
        "divide": [(body, f"{loss} = {mean} / {k}"), (body, f"{loss}.backward()")],
        "divide-in-place": [
            (body, f"{loss} = {mean}"),
            (body, f"{loss} /= {k}"),
            (body, f"{loss}.backward()"),
        ],
        "divide-at-backward": [(body, f"{loss} = {mean}"), (body, f"({loss} / {k}).backward()")],
        "scaler": [(body, f"{loss} = {mean}"), (body, f"scaler.scale({loss} / {k}).backward()")],
        "no-division": [(body, f"{loss} = {mean}"), (body, f"{loss}.backward()")],
    }[shape.form]
    step = (
        ["scaler.step(optimizer)", "scaler.update()"]
        if shape.form == "scaler"
        else ["optimizer.step()"]
    )
    if shape.window == "modulo":
        out.append((1, f"if ({shape.step} + 1) % {k} == 0:"))
        out += [(2, statement) for statement in [*step, "optimizer.zero_grad()"]]
    else:
        out += [(1, statement) for statement in [*step, "optimizer.zero_grad()"]]
    return out


def render(
    statements, indent: str, newline: str, comments: dict[int, str], notes: dict[int, str]
) -> str:
    """The file's text: `comments[i]` ends statement i, `notes[i]` is a comment line before it."""
    text = []
    for number, (level, statement) in enumerate(statements):
        if number in notes:
            text.append(indent * level + notes[number] + newline)
        text.append(
            indent * level
            + statement
            + (f"  {comments[number]}" if number in comments else "")
            + newline
        )
    return "".join(text)


COMMENT_TEXT = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters="\x85"),
    max_size=12,
)


@st.composite
def programs(draw) -> tuple[bytes, list[str], str, str]:
    """(source bytes, its comments, its newline, its indentation unit)."""
    shape = Shape(
        draw(st.sampled_from(SOURCES)),
        draw(st.sampled_from(FORMS)),
        draw(st.sampled_from(WINDOWS)),
        draw(st.booleans()),
        loss=draw(st.sampled_from(["loss", "l", "mb_loss", "train_loss"])),
        divisor=draw(
            st.sampled_from(
                [
                    "accum_steps",
                    "gradient_accumulation_steps",
                    "args.gradient_accumulation_steps",
                    "grad_accum",
                ]
            )
        ),
        step=draw(st.sampled_from(["step", "i", "batch_idx"])),
        batch=draw(st.sampled_from(["batch", "inputs", "mb"])),
    )
    statements = lines(shape)
    where = st.sets(st.integers(0, len(statements) - 1), max_size=len(statements))
    tagged = iter(range(10**6))
    comments = {n: f"# c{next(tagged)} {draw(COMMENT_TEXT)}".rstrip() for n in sorted(draw(where))}
    notes = {
        n: f"# n{next(tagged)} {draw(COMMENT_TEXT)}".rstrip() for n in sorted(draw(where)) if n > 0
    }
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    indent = draw(st.sampled_from(["    ", "  ", "\t"]))
    text = render(statements, indent, newline, comments, notes)
    event(f"{shape.source} / {shape.form} / {shape.window}")
    return text.encode(), [*comments.values(), *notes.values()], newline, indent


def comments_of(text: str) -> list[str]:
    return [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("properties") / "train.py"


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(programs())
@example(  # a long line of the user's that the fix rewrites, re-wrapped in a tab-indented file
    program=(
        (
            b"import torch.nn.functional as F\n"
            b"for step, batch in enumerate(loader):\n"
            b'\tlogits = model(batch["input_ids"])\n'
            b"\tloss = F.cross_entropy(logits.view(-1, logits.size(-1)), "
            b'batch["labels"].view(-1), ignore_index=-100) / accum_steps\n'
            b"\tloss.backward()\n"
            b"\tif (step + 1) % accum_steps == 0:\n"
            b"\t\toptimizer.step()\n"
            b"\t\toptimizer.zero_grad()\n"
        ),
        [],
        "\n",
        "\t",
    )
)
@example(  # a last comment ending in a backslash: libcst's code drops the newline after it
    program=(
        (
            b"import torch  # c0\n"
            b"import torch.nn as nn  # c1\n"
            b"import torch.nn.functional as F  # c2\n"
            b"from transformers import AutoModelForCausalLM  # c3\n"
            b'model = AutoModelForCausalLM.from_pretrained("gpt2")  # c4\n'
            b"collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)  # c5\n"
            b"for update in range(max_updates):  # c6\n"
            b"    for micro_step in range(accum_steps):  # c7\n"
            b"        batch = next(batches)  # c8\n"
            b"        outputs = model(**batch)  # c9\n"
            b"        loss = outputs.loss / accum_steps  # c10\n"
            b"        loss.backward()  # c11\n"
            b"    optimizer.step()  # c12\n"
            b"    optimizer.zero_grad()  # c13 \\\n"
        ),
        [f"# c{n}" for n in range(13)] + ["# c13 \\"],
        "\n",
        "    ",
    )
)
def test_fix_compiles_keeps_comments_and_layout_is_idempotent_and_clears_findings(scratch, program):
    data, comments, newline, indent = program
    compile(data, "train.py", "exec")
    assert sorted(comments_of(data.decode())) == sorted(comments)  # the generator's own claim
    result = fix_source(data, Path("train.py"), ALL, unsafe=True)
    after = result.after
    event("fixed" if result.changed else "unchanged")
    compile(after, "train.py", "exec")
    assert fix_source(after, Path("train.py"), ALL, unsafe=True).after == after
    text = after.decode()
    for comment in comments:
        assert comment in text
    assert all(line.endswith(newline.encode()) for line in after.splitlines(keepends=True))
    for line in text.splitlines():
        leading = line[: len(line) - len(line.lstrip())]
        assert leading == indent * (len(leading) // len(indent)), repr(line)
    scratch.write_bytes(after)
    remaining = Counter(f.code for f in check_file(scratch, ALL).findings)
    skipped = Counter(o.site.code for o in result.outcomes if not o.applied)
    assert remaining <= skipped, (remaining, skipped)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_shape_is_found_and_fixed(source, form, window):
    """The generator's shapes are real findings that the codemod rewrites, so the
    property above exercises the rewrite rather than the no-op."""
    text = render(lines(Shape(source, form, window, padding=True)), "    ", "\n", {}, {})
    result = fix_source(text.encode(), Path("train.py"), ALL, unsafe=True)
    assert result.outcomes, text
    assert result.changed, [o.reason for o in result.outcomes]
