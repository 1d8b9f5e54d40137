"""The prefix-affinity policy alone: chained prefix names, the table, the choice."""

from __future__ import annotations

import json
import random

from carpool.distributed.routing import (
    CHUNK_CHARS,
    AffinityTable,
    choose,
    power_of_two,
    prefix_chain,
    routing_text,
)

SYSTEM = "You answer in French. " * 20  # 440 characters: three whole chunks
RNG = random.Random(0)


def test_prompts_share_names_exactly_as_far_as_they_share_whole_chunks() -> None:
    a = prefix_chain(SYSTEM + "What is the time?")
    b = prefix_chain(SYSTEM + "Where is the station? " * 10)
    assert len(a) == len(SYSTEM + "What is the time?") // CHUNK_CHARS
    assert a[:3] == b[:3]
    different = prefix_chain("X" + SYSTEM[1:])
    assert not set(different) & set(a)
    assert prefix_chain("short") == []


def test_a_known_prefix_goes_to_its_owner_unless_it_is_too_busy() -> None:
    table = AffinityTable()
    chain = prefix_chain(SYSTEM + "first question")
    table.record(chain, "b")
    again = prefix_chain(SYSTEM + "another question entirely")
    choice = choose(table, again, {"a": 0, "b": 3}, max_imbalance=4, rng=RNG)
    assert choice.ranked[0] == "b" and choice.matched_chunks == 3
    busy = choose(table, again, {"a": 0, "b": 5}, max_imbalance=4, rng=RNG)
    assert busy.ranked == ("a", "b") and busy.matched_chunks == 0


def test_a_new_prefix_goes_to_the_least_busy_then_to_whoever_holds_fewest() -> None:
    table = AffinityTable()
    table.record(prefix_chain(SYSTEM), "a")
    fresh = prefix_chain("Y" * 500)
    assert choose(table, fresh, {"a": 0, "b": 0}, 4, RNG).ranked[0] == "b"
    assert choose(table, fresh, {"a": 0, "b": 1}, 4, RNG).ranked[0] == "a"
    assert choose(table, [], {"a": 2, "b": 1}, 4, RNG).ranked == ("b", "a")
    assert choose(table, fresh, {}, 4, RNG).ranked == ()


def test_a_dead_replica_is_forgotten_and_never_chosen() -> None:
    table = AffinityTable()
    chain = prefix_chain(SYSTEM)
    table.record(chain, "a")
    assert choose(table, chain, {"b": 0, "c": 0}, 4, RNG).matched_chunks == 0
    table.forget("a")
    assert len(table) == 0 and table.owned("a") == 0


def test_the_table_forgets_least_recently_used_names_past_its_capacity() -> None:
    table = AffinityTable(capacity=4)
    table.record(prefix_chain("A" * 384), "a")  # three names
    table.record(prefix_chain("B" * 384), "b")  # three more: the oldest two go
    assert len(table) == 4
    assert table.owned("a") == 1 and table.owned("b") == 3
    assert table.longest_match(prefix_chain("A" * 384), {"a": 0}) == (None, 0)


def test_routing_text_reads_the_prompt_of_generation_requests_only() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "sys "},
            {"role": "user", "content": [{"type": "text", "text": "part"}, {"type": "x"}]},
            "not a message",
        ]
    }
    assert routing_text("/v1/chat/completions", json.dumps(chat).encode()) == "sys part"
    assert routing_text("/v1/completions", b'{"prompt": "once upon"}') == "once upon"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == ""
    assert routing_text("/v1/embeddings", b'{"input": "x"}') == ""
    assert routing_text("/v1/completions", b"{not json") == ""
    assert routing_text("/v1/completions", b"[1]") == ""
    long = json.dumps({"prompt": "z" * 100_000}).encode()
    assert len(routing_text("/v1/completions", long, limit=256)) == 256


def test_a_prompt_cache_key_is_the_first_chunk_so_sharing_it_shares_a_replica() -> None:
    keyed = [
        routing_text("/v1/chat/completions", json.dumps(body).encode())
        for body in (
            {"prompt_cache_key": "user-7", "messages": [{"role": "user", "content": "hi"}]},
            {"prompt_cache_key": "user-7", "messages": [{"role": "user", "content": "bye"}]},
            {"prompt_cache_key": "user-8", "messages": [{"role": "user", "content": "hi"}]},
        )
    ]
    chains = [prefix_chain(text) for text in keyed]
    assert all(len(chain) == 1 for chain in chains)  # the key alone makes a whole chunk
    assert chains[0] == chains[1] != chains[2]
    assert keyed[0].endswith("hi") and keyed[0].startswith("user-7")


def test_power_of_two_picks_two_distinct_replicas_at_random() -> None:
    rng = random.Random(7)
    picks = [power_of_two(["a", "b", "c"], rng) for _ in range(60)]
    assert all(len(p) == 2 and p[0] != p[1] for p in picks)
    assert {frozenset(p) for p in picks} == {frozenset("ab"), frozenset("ac"), frozenset("bc")}
    assert power_of_two(["only"], rng) == ("only",)


def test_equally_busy_replicas_with_equal_prefixes_are_picked_at_random() -> None:
    table = AffinityTable()
    firsts = {choose(table, [], {"a": 1, "b": 1}, 4, random.Random(i)).ranked[0] for i in range(20)}
    assert firsts == {"a", "b"}
