"""Record a pipeline's text-encoder calls: which texts each call encoded, in order."""

from __future__ import annotations


def record_encoder_calls(pipe, monkeypatch) -> list[list[str]]:
    """The texts of every call of ``pipe.family.encode_prompts`` from now on, appended to the
    returned list as they happen (monkeypatch restores the family at the test's end)."""
    calls: list[list[str]] = []
    encode = pipe.family.encode_prompts

    def counted(pipe_, texts, max_sequence_length):
        calls.append(list(texts))
        return encode(pipe_, texts, max_sequence_length)

    monkeypatch.setattr(pipe.family, "encode_prompts", counted)
    return calls
