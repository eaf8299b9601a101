"""engine/io/request_validation.py: a prompt's token ids are checked in C-speed passes, and one
that fails them is walked for the offending id, so the error names it."""

from __future__ import annotations

import enum

import pytest

from splitserve.engine.io.request_validation import validate_prompt
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

VOCAB = 100


class Token(enum.IntEnum):
    A = 7


def check(ids: list) -> None:
    validate_prompt(ids, SamplingParams(max_tokens=4), VOCAB, 4096, 4096)


@pytest.mark.parametrize(
    "ids, named",
    [
        ([1, 2, VOCAB], repr(VOCAB)),
        ([-1, 2], "-1"),
        ([3, True, 4], "True"),
        ([3, 2.0], "2.0"),
        ([3, "5"], "'5'"),
        ([3, None], "None"),
    ],
)
def test_a_bad_token_id_is_named(ids, named):
    with pytest.raises(InvalidRequestError, match=f"prompt token id {named} is outside the vocabulary"):
        check(ids)


def test_ids_at_the_vocabulary_edges_and_int_subclasses_other_than_bool_pass():
    check([0, VOCAB - 1])
    check([Token.A, 3])
    check(list(range(VOCAB)) * 20)
