"""Prompt-lookup drafts (starqa.phase2.lookup): what follows the latest, longest earlier occurrence
of the sequence's last tokens."""

import torch

from starqa.phase2.lookup import MAX_MATCH, Drafter


def test_proposes_what_followed_the_latest_longest_match():
    # "5 6" occurs at 1-2 (then 7 8 9) and at 6-7 (then 1 2); "4 5 6" only at 0-2
    drafter = Drafter(torch.tensor([4, 5, 6, 7, 8, 9, 5, 6, 1, 2]), [4, 5], room=8)
    assert drafter.propose(3) == [6, 7, 8]  # the buffer ends "4 5": as at 0-1
    drafter.extend([6])
    assert drafter.propose(3) == [7, 8, 9]  # 4 5 6 matched 3 long beats the later 5 6
    assert drafter.propose(2) == [7, 8]
    drafter.extend([0])  # "6 0" never occurred; a match of the last token only is no match
    assert drafter.propose(3) == []


def test_latest_of_equally_long_matches_and_the_answer_itself():
    drafter = Drafter(torch.tensor([1, 2, 3, 1, 2, 4]), [9], room=2)
    drafter.extend([1, 2])
    assert drafter.propose(4) == [4, 9, 1, 2]  # the later "1 2" (then 4), up to the end
    drafter = Drafter(None, [7, 8, 7], room=1)  # no context: the question is looked up
    drafter.extend([8])
    assert drafter.propose(3) == [7, 8]


def test_no_proposal_without_budget_or_history_and_the_buffer_grows():
    assert Drafter(None, [1], room=0).propose(3) == []
    drafter = Drafter(torch.tensor([1, 2, 3]), [1, 2], room=0)
    assert drafter.propose(0) == []
    assert drafter.propose(5) == [3, 1, 2]
    drafter.extend(list(range(100, 100 + 4 * MAX_MATCH)))  # past the room: grows
    drafter.extend([100, 101])
    assert drafter.propose(2) == [102, 103]


def test_draft_tokens_setting(monkeypatch):
    import pytest

    from starqa.phase2 import decode
    from starqa.core.errors import StarqaError

    monkeypatch.delenv("STARQA_DRAFT_TOKENS", raising=False)
    assert decode.draft_tokens_setting() == decode.DRAFT_TOKENS
    monkeypatch.setenv("STARQA_DRAFT_TOKENS", "0")
    assert decode.draft_tokens_setting() == 0
    for bad in ("-1", "three", "17"):
        monkeypatch.setenv("STARQA_DRAFT_TOKENS", bad)
        with pytest.raises(StarqaError, match="STARQA_DRAFT_TOKENS") as raised:
            decode.draft_tokens_setting()
        assert "export STARQA_DRAFT_TOKENS=3" in raised.value.hint
