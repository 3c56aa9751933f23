"""Start-up settings every server process gets (one uvicorn process or a Ray replica)."""

from specgraft.serve.launch import KERNEL_CACHE_ENTRIES, KERNEL_CACHES, bound_kernel_caches


def test_the_kernel_caches_are_bounded_unless_the_user_chose():
    environ: dict = {}
    assert bound_kernel_caches(environ) == {name: str(KERNEL_CACHE_ENTRIES) for name in KERNEL_CACHES}
    assert set(environ) == {"LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    chosen = {"LRU_CACHE_CAPACITY": "1024"}
    assert bound_kernel_caches(chosen)["LRU_CACHE_CAPACITY"] == "1024"
    assert chosen == {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_ENTRIES)}
