"""BufferPool: read buffers reused within a byte budget (offload/io/buffer_pool.py)."""

import threading
import time

from tierflow.offload.io.buffer_pool import BufferPool, BufferPoolClosed
from tierflow.offload.io.disk import ALIGNMENT

PAGE = ALIGNMENT


def test_a_given_back_buffer_is_reused_with_its_contents():
    pool = BufferPool(4 * PAGE)
    buffer = pool.take(PAGE)
    buffer[:5] = b"hello"
    pool.give(buffer)
    again = pool.take(PAGE)
    assert again is buffer and again[:5] == b"hello" and pool.mapped_bytes == PAGE


def test_sizes_are_rounded_up_to_the_alignment():
    pool = BufferPool(4 * PAGE)
    assert len(pool.take(PAGE + 1)) == 2 * PAGE and pool.mapped_bytes == 2 * PAGE


def test_free_buffers_of_another_size_are_unmapped_to_make_room():
    pool = BufferPool(3 * PAGE)
    pool.give(pool.take(2 * PAGE))
    assert len(pool.take(3 * PAGE)) == 3 * PAGE and pool.mapped_bytes == 3 * PAGE


def test_take_waits_within_the_budget_until_a_buffer_comes_back():
    pool = BufferPool(2 * PAGE)
    held = [pool.take(PAGE), pool.take(PAGE)]
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(pool.take(PAGE)))
    waiter.start()
    time.sleep(0.1)
    assert not taken and pool.mapped_bytes == 2 * PAGE  # nothing mapped beyond the budget
    pool.give(held[0])
    waiter.join(timeout=5)
    assert taken == [held[0]] and pool.mapped_bytes == 2 * PAGE


def test_closing_ends_a_take_that_waits_for_a_buffer():
    pool = BufferPool(PAGE)
    pool.take(PAGE)  # held for good: nothing will come back
    outcome = []

    def wait_for_one() -> None:
        try:
            pool.take(PAGE)
        except BufferPoolClosed as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    pool.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and len(outcome) == 1
