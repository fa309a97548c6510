"""The MAC of shared-tier values (tiers/mac.py): what it accepts and why it refuses the rest."""

from __future__ import annotations

import pytest

from tiers.mac import BAD_TAG, MIN_SECRET_CHARS, TRAILER_BYTES, UNKNOWN_SECRET, UNSIGNED, BlockMac

OLD, NEW, OTHER = b"o" * 40, b"n" * 40, b"x" * 40
KEY, KEY2 = b"k" * 16, b"j" * 16
BLOCK = bytes(range(256)) * 64


def test_a_sealed_block_opens_to_itself() -> None:
    mac = BlockMac(NEW)
    sealed = mac.seal(KEY, BLOCK)
    assert len(sealed) == len(BLOCK) + TRAILER_BYTES and sealed.startswith(BLOCK)
    body, fault = mac.open(KEY, sealed)
    assert fault is None and body == BLOCK
    body, fault = mac.open(KEY, memoryview(bytearray(sealed)))  # any buffer
    assert fault is None and body == BLOCK


@pytest.mark.parametrize("where", ["first", "middle", "last", "tag"])
def test_any_changed_byte_is_refused(where: str) -> None:
    mac = BlockMac(NEW)
    bad = bytearray(mac.seal(KEY, BLOCK))
    bad[{"first": 0, "middle": len(BLOCK) // 2, "last": len(BLOCK) - 1, "tag": -1}[where]] ^= 1
    assert mac.open(KEY, bytes(bad))[1] == BAD_TAG


def test_the_key_is_covered() -> None:
    """A valid value copied under another key does not verify."""
    mac = BlockMac(NEW)
    assert mac.open(KEY2, mac.seal(KEY, BLOCK))[1] == BAD_TAG


def test_a_value_without_a_trailer_is_unsigned() -> None:
    mac = BlockMac(NEW)
    assert mac.open(KEY, BLOCK) == (memoryview(BLOCK), UNSIGNED)
    assert mac.open(KEY, b"")[1] == UNSIGNED
    assert mac.open(KEY, mac.seal(KEY, BLOCK)[:-1])[1] == UNSIGNED  # a trailer cut short


def test_rotation_previous_secrets_verify_and_never_sign() -> None:
    old, rotating, new_only = BlockMac(OLD), BlockMac(NEW, [OLD]), BlockMac(NEW)
    by_old = old.seal(KEY, BLOCK)
    assert rotating.open(KEY, by_old)[1] is None  # still accepted while listed
    assert new_only.open(KEY, by_old)[1] == UNKNOWN_SECRET  # refused once dropped
    assert rotating.seal(KEY, BLOCK) == new_only.seal(KEY, BLOCK)  # signs with the current one only
    assert old.open(KEY, rotating.seal(KEY, BLOCK))[1] == UNKNOWN_SECRET
    assert BlockMac(OTHER).open(KEY, by_old)[1] == UNKNOWN_SECRET


def test_a_forged_tag_under_a_known_secret_id_is_refused() -> None:
    """Knowing which secret signs (its id is in every trailer) does not help to sign."""
    mac = BlockMac(NEW)
    sealed = mac.seal(KEY, BLOCK)
    forged = BlockMac(OTHER).seal(KEY, BLOCK)
    spliced = sealed[: -32] + forged[-32:]  # the right id, a tag made with another secret
    assert mac.open(KEY, spliced)[1] == BAD_TAG


def test_short_secrets_are_refused_and_the_repr_shows_ids() -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_CHARS}"):
        BlockMac(b"s" * (MIN_SECRET_CHARS - 1))
    with pytest.raises(ValueError):
        BlockMac(NEW, [b"short"])
    shown = repr(BlockMac(NEW, [OLD]))
    assert BlockMac(NEW).current_id in shown and BlockMac(OLD).current_id in shown and NEW.decode() not in shown
