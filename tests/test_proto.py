"""The committed protocol stubs are exactly what `python -m kvstore.codegen` makes."""

from kvstore.codegen import GENERATED_PACKAGE, REPO_ROOT, generate


def test_generated_stubs_are_up_to_date(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "codegen produced nothing"
    for path in fresh:
        committed = REPO_ROOT / GENERATED_PACKAGE / path.name
        assert committed.exists(), f"{committed} missing: run python -m kvstore.codegen"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run python -m kvstore.codegen"
        )
