import pytest

from gateway.auth import KeyLimits, parse_key_line
from gateway.tenancy import cache_scope, clamp_priority
from kvstore.hashing import DEFAULT_HASH_KEY, generate_hash_key
from mesh import metrics


def key(line: str):
    return parse_key_line(line, KeyLimits(), 1)


def test_key_line_tenant_group_and_max_priority():
    k = key("sk-a tenant=acme cache_group=shared max_priority=5 role=user")
    assert (k.tenant, k.cache_group, k.max_priority, k.cache_owner) == ("acme", "shared", 5, "group:shared")
    assert key("sk-a tenant=acme").cache_owner == "tenant:acme"
    assert key("sk-a").max_priority == 0 and key("sk-a role=admin").max_priority is None
    assert key("sk-a role=admin max_priority=-1").max_priority == -1
    own = key("sk-secret").cache_owner  # a key without a tenant is its own, named without the key
    assert own.startswith("key:") and "sk-secret" not in own and own != key("sk-other").cache_owner
    for bad in ("sk max_priority=x", "sk max_priority=99999999999", "sk tenancy=a"):
        with pytest.raises(ValueError, match="line 1"):
            key(bad)


def test_cache_scope_separates_tenants_and_salts_and_groups_share():
    h = generate_hash_key()
    a, b = key("sk-a tenant=a"), key("sk-b tenant=b")
    ga, gb = key("sk-a tenant=a cache_group=g"), key("sk-b tenant=b cache_group=g")
    scopes = {cache_scope(h, a, None), cache_scope(h, b, None), cache_scope(h, a, "s1"), cache_scope(h, a, "s2"),
              cache_scope(h, ga, None), cache_scope(h, None, "s1")}
    assert len(scopes) == 6
    assert cache_scope(h, ga, None) == cache_scope(h, gb, None)
    assert cache_scope(h, None, None) == ""  # keys off, no salt: the one shared scope
    assert cache_scope(h, a, None) != cache_scope(DEFAULT_HASH_KEY, a, None)  # a keyed digest


def test_priority_clamped_to_the_keys_max():
    before = metrics.GATEWAY_PRIORITY_CLAMPED._value.get()
    assert clamp_priority(2**31 - 1, key("sk max_priority=3")) == 3
    assert clamp_priority(1, key("sk")) == 0
    assert clamp_priority(-1, key("sk")) == -1  # lower priorities are any key's to take
    assert clamp_priority(2**31 - 1, key("sk role=admin")) == 2**31 - 1
    assert clamp_priority(7, None) == 7  # keys off: one tenant, no clamp
    assert metrics.GATEWAY_PRIORITY_CLAMPED._value.get() == before + 2
