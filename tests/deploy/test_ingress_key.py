"""The key ingress-nginx hashes each request on. Its Lua balancer (balancer/chash.lua) builds the key
with util.generate_var_value: the upstream-hash-by expression's variables, read from ngx.var, a
missing one dropped, concatenated; then it looks the key up on a consistent ring, an empty key
like any other. So a key that is empty for every stateless request sends them all to one pod.
The component's key comes from a map in the controller's http-snippet: never empty. The same map
is what tests/e2e/test_balancer.py runs in nginx."""

from __future__ import annotations

import re
import textwrap
import uuid

import yaml

from tests.deploy.test_k8s import render
from tests.support import ROOT

COMPONENT = ROOT / "deploy" / "k8s" / "components" / "ingress-nginx"
NGINX_CONF = ROOT / "deploy" / "nginx" / "mha-serve.conf"
VARIABLE = re.compile(r"\$\{?([0-9a-zA-Z_]+)\}?")


def _snippet() -> str:
    values = yaml.safe_load((COMPONENT / "controller-values.yaml").read_text())
    return values["controller"]["config"]["http-snippet"]


def _maps(text: str) -> dict[str, tuple[str, dict[str, str]]]:
    """nginx `map $source $target { "value" $result; default $result; }` blocks, by target."""
    found = {}
    for source, target, body in re.findall(r"map \$(\w+) \$(\w+) \{(.*?)\n\s*\}", text, re.S):
        entries = dict(re.findall(r'^\s*("[^"]*"|default)\s+(\S+);', body, re.M))
        found[target] = (source, {key.strip('"') if key != "default" else key: v for key, v in entries.items()})
    return found


def _key(expression: str, variables: dict[str, str], maps: dict[str, tuple[str, dict[str, str]]]) -> str:
    """The key chash.lua hashes: each variable's value (a map's result for a map's target), a
    missing one contributing nothing, as generate_var_value drops ngx.var's nil."""

    def value(name: str) -> str:
        if name in maps:
            source, entries = maps[name]
            result = entries.get(variables.get(source, ""), entries["default"])
            return _key(result, variables, maps)
        return variables.get(name, "")

    return VARIABLE.sub(lambda m: value(m.group(1)), expression)


def _hash_by() -> list[str]:
    ingresses = [d for d in render("cpu-ingress-nginx") if d["kind"] == "Ingress"]
    assert len(ingresses) == 2  # gRPC and HTTP
    return [i["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] for i in ingresses]


def test_a_stateless_request_is_never_hashed_on_an_empty_key() -> None:
    maps = _maps(_snippet())
    for expression in _hash_by():
        keyless = {_key(expression, {"request_id": uuid.uuid4().hex}, maps) for _ in range(50)}
        assert "" not in keyless and len(keyless) == 50  # a key of its own each: spread over the ring
        steps = {
            _key(expression, {"http_mha_sequence_id": "s-1", "request_id": uuid.uuid4().hex}, maps) for _ in range(5)
        }
        assert steps == {"s-1"}  # every step of a sequence: the same key, the same pod
    # what the header alone gave (the component before): one key, "", for every stateless request
    assert {_key("$http_mha_sequence_id", {"request_id": uuid.uuid4().hex}, {}) for _ in range(50)} == {""}


def test_the_controllers_map_is_the_one_the_nginx_test_runs() -> None:
    conf = NGINX_CONF.read_text()
    block = re.search(r"\n(\s*)(map \$http_mha_sequence_id .*?\n\1\})", conf, re.S)
    assert block is not None
    assert textwrap.dedent(block.group(1) + block.group(2)).strip() == textwrap.dedent(_snippet()).strip()
    assert conf.count("hash $mha_balance_key consistent;") == 2  # both upstreams, gRPC and HTTP
