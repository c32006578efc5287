"""Launcher inputs: the world size range and the rendezvous address check."""

import pytest

from dpscale.train.launch import parse_nproc, rendezvous_warning


@pytest.mark.parametrize("text,expected", [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_nproc_is_n_or_a_range(text, expected):
    assert parse_nproc(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "3:2", "0:2", "two", "1:", ":2", "1:2:3"])
def test_bad_nproc_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="N or MIN:MAX"):
        parse_nproc(text)


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1", "localhost", None, ""])
def test_loopback_rendezvous_needs_no_warning(addr):
    assert rendezvous_warning(addr) is None


@pytest.mark.parametrize("addr", ["10.0.0.7", "192.168.1.20", "no-such-host.invalid"])
def test_other_rendezvous_addresses_get_a_warning_about_the_unauthenticated_store(addr):
    warning = rendezvous_warning(addr)
    assert warning and addr in warning and "no authentication" in warning and "trusted network" in warning
