"""bench/serving/pyspy_summary.py: a py-spy raw profile summed per function, self and inclusive."""

from __future__ import annotations

import pytest

from splitserve.bench.serving.pyspy_summary import summarize

pytestmark = pytest.mark.unit


def test_self_and_inclusive_shares_merge_lines_of_one_function(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (app.py:1);relay (ingress.py:10);encode (json.py:5) 3\n"
        "main (app.py:1);relay (ingress.py:12) 1\n"  # another line of relay: the same function
        "\n"
        "main (app.py:2);idle (loop.py:3) 4\n"
    )
    text = summarize(str(raw))
    own, inclusive = text.split("inclusive:")
    assert text.startswith(f"{raw}: 8 samples")
    assert " 37.5% encode (json.py)" in own and " 12.5% relay (ingress.py)" in own and " 50.0% idle (loop.py)" in own
    assert " 50.0% relay (ingress.py)" in inclusive and "100.0% main (app.py)" in inclusive
