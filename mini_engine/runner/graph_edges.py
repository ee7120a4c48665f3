"""Programmatic edges into cuBLAS's GEMMs in a captured decode graph.

Our Triton kernels take part in programmatic dependent launch (kernels/triton_utils.py): each is
launched with `launch_pdl`, so stream capture joins it to the kernel ahead by a programmatic edge,
and it may become resident while that kernel finishes. A cuBLAS GEMM is launched by cuBLAS,
without that attribute, so the edge into it is a full one: it starts only after the kernel ahead
has ended and flushed, four times a layer. Its kernels (cuBLAS 13's `nvjet_*`) wait on their grid
dependency themselves (`griddepcontrol.wait`, ACQBULK in their machine code) before they read, so
the edge into one can be programmatic too. This rewrites those edges in the captured graph before
it is instantiated. The GPU test (tests/runner/test_pdl.py) holds every captured size's logits to
those of the graph without the rewrite, bit for bit: a GEMM that did not wait would read its input
before the kernel ahead wrote it."""
import functools

import torch

from mini_engine.kernels.triton_utils import use_pdl

GEMM_KERNEL_PREFIXES = ("nvjet_",)


@functools.lru_cache
def gemm_edges_enabled(device: torch.device) -> bool:
    """With PDL on (use_pdl: Hopper or newer, MINI_ENGINE_PDL not 0) and CUDA's Python bindings
    (`cuda-bindings`, which the graph API needs) importable."""
    if not use_pdl(device):
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _check(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def programmatic_gemm_edges(graph: torch.cuda.CUDAGraph, prefixes: tuple[str, ...] = GEMM_KERNEL_PREFIXES) -> int:
    """Turns every full edge from a kernel node into a kernel node whose function name starts with
    one of prefixes into a programmatic one. graph must be captured with keep_graph=True and not
    yet instantiated (or be instantiated again after). Returns how many edges changed."""
    from cuda.bindings import driver

    handle = driver.CUgraph(graph.raw_cuda_graph())
    count = _check(driver.cuGraphGetNodes(handle, 0))[1]
    nodes = _check(driver.cuGraphGetNodes(handle, count))[0]
    names = {}
    for node in nodes:
        if _check(driver.cuGraphNodeGetType(node)) == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            params = _check(driver.cuGraphKernelNodeGetParams(node))
            name = (_check(driver.cuFuncGetName(params.func)) if int(params.func)
                    else _check(driver.cuKernelGetName(params.kern)))
            names[int(node)] = name.decode()
    programmatic = driver.CUgraphEdgeData()
    programmatic.from_port = int(driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)
    programmatic.type = int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    changed = 0
    for node in nodes:
        if not names.get(int(node), "").startswith(prefixes):
            continue
        num_deps = _check(driver.cuGraphNodeGetDependencies(node, 0))[2]
        deps, edges, _ = _check(driver.cuGraphNodeGetDependencies(node, num_deps))
        for dep, edge in zip(deps, edges):
            if int(dep) not in names or int(edge.type) != 0 or int(edge.from_port) != 0:
                continue                 # a memcpy or memset ahead, or already programmatic
            _check(driver.cuGraphRemoveDependencies(handle, [dep], [node], None, 1))
            _check(driver.cuGraphAddDependencies(handle, [dep], [node], [programmatic], 1))
            changed += 1
    return changed
