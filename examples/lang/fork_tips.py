"""Fork and join (SGLang's "tips" program): the tips are expanded in parallel forks that share the text before the
fork (prefilled once), then joined back: as variables (``gather_variable``) or as text (``concate_and_append``)."""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl

TIPS = ["Balanced diet", "Regular exercise", "Enough sleep"]
INTRO = "Here are three tips for staying healthy: " + "; ".join(f"{i + 1}. {t}" for i, t in enumerate(TIPS)) + ".\n"


@sgl.function
def tips(s: Any, join_mode: str = "gather_variable") -> Any:
    s += INTRO
    forks = s.fork(len(TIPS))
    forks += lambda i: f"\nNow, expand tip {i + 1} into a sentence.\nTip {i + 1}:"
    forks += sgl.gen("detailed_tip", max_tokens=16, stop="\n")
    forks.join(join_mode)
    if join_mode == "gather_variable":
        for i, tip in enumerate(s["detailed_tip"]):
            s += f"Tip {i + 1}: {tip.strip()}\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=16, stop="\n")
    return forks  # the program's return value: state.ret_value


def run_example() -> list[Any]:
    """The program joined both ways."""
    return [tips.run(join_mode="gather_variable"), tips.run(join_mode="concate_and_append")]


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    for state in run_example():
        print(state.text(), end="\n---\n")
