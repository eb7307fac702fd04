"""Trace records: the engine's quick constructor makes the same frozen record as the dataclass."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tinyinfer.trace import Candidate, SeqStep


def test_from_fields_makes_the_record_the_dataclass_makes():
    values = dict(seq_id=3, request_id="r", kind="decode", start=7, end=8, token_ids=(5,),
                  token_id=9, token_text="a", logprob=-0.5, token_prob=1.0,
                  candidates=(Candidate(9, 1.0, "a"),))
    quick, plain = SeqStep.from_fields(values), SeqStep(**values)
    assert quick == plain and hash(quick) == hash(plain) and repr(quick) == repr(plain)
    assert dataclasses.asdict(quick) == dataclasses.asdict(plain)
    assert dataclasses.replace(quick, end=9) == dataclasses.replace(plain, end=9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.end = 9  # type: ignore[misc]
    values["token_id"] = 10  # the record keeps its own fields, not the caller's dict
    assert quick.token_id == 9


@pytest.mark.parametrize("values, named", [
    (dict(seq_id=1, request_id="r", kind="decode", start=0), "['end']"),
    (dict(seq_id=1, request_id="r", kind="decode", start=0, end=1, token=2), "['token']"),
    (dict(seq_id=1, request_id="r", kind="decode", start=0, ends=1), "['ends']"),
])
def test_from_fields_refuses_a_missing_or_unknown_field(values, named):
    with pytest.raises(TypeError, match=re.escape(named)):
        SeqStep.from_fields(values)
