"""The gateway's OpenAPI document is a contract with every client generated from it: moving the
gateway's modules (or anything else that should not change the API) must leave it as it was.
``tests/data/openapi.json`` is the document as served; regenerate it only for a deliberate API change:

    python -c "from tests.unit.test_openapi_snapshot import write; write()"
"""

import json
from pathlib import Path

SNAPSHOT = Path(__file__).parent.parent / "data" / "openapi.json"


def served_document(model_dir: Path) -> dict:
    from gateway.app import create_app
    from gateway.service import Gateway, GatewayConfig

    app = create_app(Gateway(GatewayConfig(nats_url="nats://127.0.0.1:1", model_dirs=(str(model_dir),))))
    return json.loads(json.dumps(app.openapi()))  # tuples as lists, as the wire has them


def write() -> None:
    import tempfile

    from engine.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as d:
        doc = served_document(write_tiny_model(Path(d) / "tiny"))
    SNAPSHOT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def test_the_openapi_document_is_the_snapshot(tiny_model):
    doc = served_document(tiny_model)
    want = json.loads(SNAPSHOT.read_text())
    assert sorted(doc["paths"]) == sorted(want["paths"])  # a route lost or added reads plainly
    assert doc == want
