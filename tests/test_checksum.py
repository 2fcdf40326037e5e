"""The pack's checksum is zlib's CRC-32, bit for bit, at every length, alignment and start value."""

import os
import zlib

import pytest

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.checksum import crc32

LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096, 65536 + 17]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("offset", [0, 3])
def test_crc32_is_zlibs_at_every_length_and_alignment(length, offset):
    data = memoryview(os.urandom(length + offset))[offset:]
    assert _kernels.crc32(data) == zlib.crc32(data)


@pytest.mark.parametrize("start", [0, 1, 0xFFFFFFFF, 123456789])
def test_crc32_continues_from_a_start_value_as_zlib_does(start):
    data = os.urandom(300)
    assert _kernels.crc32(data, start) == zlib.crc32(data, start)


def test_crc32_of_a_part_continues_into_the_next():
    data = os.urandom(1000)
    assert _kernels.crc32(data[600:], _kernels.crc32(data[:600])) == zlib.crc32(data)


def test_the_packs_checksum_gives_zlibs_value():
    data = os.urandom(5000)
    assert crc32(data) == zlib.crc32(data)


def test_crc32_refuses_what_is_not_a_buffer():
    with pytest.raises(TypeError):
        _kernels.crc32("text")
