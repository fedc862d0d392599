"""The README's Python examples of the layer and the baselines run as written, and print what their comments say."""
import ast
import contextlib
import io
import re
from pathlib import Path

from lavo import available_attentions

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.DOTALL)


def test_the_layer_and_baseline_examples_run_in_order_and_print_what_they_say():
    layer_example, baselines_example = BLOCKS[0], BLOCKS[1]
    assert "LavoAttention(" in layer_example and "build_attention(" in baselines_example
    namespace = {}
    printed = run(layer_example, namespace)
    assert tuple(namespace["y"].shape) == (2, 4096, 512) and printed == [str(namespace["cache"].nbytes())]
    # the baselines example continues the session: it calls its layer on the first example's `x`
    printed = run(baselines_example, namespace)
    said = re.search(r"print\(available_attentions\(\)\)\s+# (\[.*\])", baselines_example).group(1)
    assert printed == [said] and ast.literal_eval(said) == available_attentions()
    assert tuple(namespace["y"].shape) == (2, 4096, 512)


def run(source: str, namespace: dict) -> list[str]:
    """Execute ``source`` in ``namespace``; the lines it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "README.md", "exec"), namespace)
    return printed.getvalue().splitlines()
