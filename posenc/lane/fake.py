"""Make torch, Inductor and Triton see a GPU that is not there, so Inductor generates and Triton compiles its kernels.

``install(gpu)`` answers torch.cuda's queries as that GPU, hands Triton a CUDA driver that never loads libcuda and
targets the GPU's compute capability, and replaces Inductor's kernel loader with a recorder: every compiled Triton
kernel (every config of every kernel) lands in ``COMPILED`` with its shared memory, warps, stages and PTX, and is
checked as loading it on the GPU would check it (shared memory against the opt-in maximum, threads per block). A
kernel none of whose configs fits raises the GPU's own error ("No valid triton configs. OutOfResources ..."), as
Inductor does on the device. Launches do nothing.

Tensors must be fake (``FakeTensorMode``) on ``"cuda"``; a compile-only backend returns ``never_run``. Set
``TORCHINDUCTOR_COMPILE_THREADS=1`` (Triton then compiles in this process, where the mocks are) and
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` (every kernel really compiles) before torch is imported. The mocks touch
torch 2.11's internals (``posenc.lane.PINNED``); one install per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posenc.lane.gpus import GPU


@dataclass
class Kernel:
    """One compiled config of one Triton kernel, as the device would see it when loading it."""

    name: str
    shared: int
    num_warps: int
    num_stages: int
    ptx: str
    error: str | None  # what loading it on the device would say, or None when it fits


COMPILED: list[Kernel] = []
_installed: list[GPU] = []


class NotRunError(Exception):
    """Raised instead of running a graph Inductor compiled: there is no GPU to run it on."""


def installed() -> GPU:
    """The GPU this process pretends to have."""
    if not _installed:
        raise RuntimeError("no fake GPU installed in this process (posenc.lane.fake.install)")
    return _installed[0]


def install(gpu: GPU) -> None:
    """Pretend to be ``gpu`` for the rest of the process (see the module docstring)."""
    if _installed:
        if _installed[0] != gpu:
            raise RuntimeError(f"this process already pretends to be {_installed[0].key}; use one process per GPU")
        return
    _installed.append(gpu)
    _fake_torch_cuda(gpu)
    _fake_triton_driver(gpu)
    _record_instead_of_loading(gpu)


def _fake_torch_cuda(gpu: GPU) -> None:
    import torch
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._dynamo.device_interface import CudaInterface

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda._exchange_device = cuda._maybe_exchange_device = lambda device: 0  # torch.cuda.device(0) as a context
    cuda.get_device_capability = lambda device=None: (gpu.major, gpu.minor)
    cuda.get_device_properties = lambda device=None: gpu
    cuda.get_device_name = lambda device=None: gpu.name
    cuda.is_bf16_supported = lambda including_emulation=True: True
    # dynamo saves and restores the CUDA RNG state around tracing
    cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = lambda new_state, device="cuda": None
    cuda.get_rng_state_all = lambda: [cuda.get_rng_state()]
    cuda.set_rng_state_all = lambda new_states: None
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None
    # The generic accelerator API keeps saying "none", or dynamo would record the current (real) CUDA stream.
    torch.accelerator.is_available = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda device: 0  # generated code asks for the stream at run time
    # FakeTensorMode would allocate a real CUDA tensor, and decides from is_available whether to initialise CUDA.
    fake_tensor.init_gpu_context = lambda device: None
    fake_tensor.FakeTensorMode.avoid_device_init = property(lambda self: True)
    torch._C._ensureCUDADeviceGuardSet()
    # dynamo's device interface bound some of these at import time
    for name in ("current_device", "set_device", "device_count", "synchronize", "get_device_properties"):
        setattr(CudaInterface, name, staticmethod(getattr(cuda, name)))
    CudaInterface.is_bf16_supported = staticmethod(cuda.is_bf16_supported)
    CudaInterface.exchange_device = staticmethod(cuda._exchange_device)
    CudaInterface.maybe_exchange_device = staticmethod(cuda._maybe_exchange_device)
    CudaInterface.get_raw_stream = staticmethod(lambda device: 0)


def _fake_triton_driver(gpu: GPU) -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Utils:
        @staticmethod
        def get_device_properties(device: int) -> dict[str, int]:
            return {
                "max_shared_mem": gpu.shared_memory_per_block_optin,
                "multiprocessor_count": gpu.multi_processor_count,
                "max_num_regs": gpu.regs_per_multiprocessor,
                "warpSize": gpu.warp_size,
                "sm_clock_rate": gpu.clock_rate,
                "mem_clock_rate": gpu.memory_clock_rate,
                "mem_bus_width": gpu.memory_bus_width,
            }

        @staticmethod
        def load_binary(*args: Any) -> Any:
            raise RuntimeError(f"fake {gpu.key}: kernels are compiled, never loaded")

    class FakeDriver(CudaDriver):  # Inductor checks for the CUDA driver class; its __init__ would link libcuda
        def __init__(self) -> None:
            self.utils = Utils()
            self.launcher_cls = None
            self.get_device_capability = torch.cuda.get_device_capability
            self.get_current_stream = lambda device=None: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", gpu.arch, gpu.warp_size)

    triton.runtime.driver.set_active(FakeDriver())


def _record_instead_of_loading(gpu: GPU) -> None:
    import torch
    from torch._inductor.runtime import triton_heuristics
    from torch.fx.experimental import proxy_tensor
    from triton.runtime.errors import OutOfResources

    torch._inductor.config.use_static_cuda_launcher = False  # keep Triton's CompiledKernel (metadata, PTX)
    # Tracing evaluates one-element constants eagerly on their device (an integer index moved to CUDA inside a
    # score_mod); with no device they stay traced values, which changes no kernel.
    proxy_tensor.CONSTANT_NUMEL_LIMIT = 0
    # Inductor folds constant subgraphs by running them on the device at compile time (the zeros a captured
    # gradient is scattered into); without a device they are compiled as kernels instead.
    torch._inductor.config.joint_graph_constant_folding = False

    def make_launchers(self: Any) -> None:
        """What loading on the GPU checks (Triton's ``CompiledKernel._init_handles``), per compiled config."""
        results = self.compile_results or []
        if len(self.launchers) == len(results):
            return
        fitting, error = 0, None
        for result in results:
            metadata = result.kernel.metadata
            problem = None
            if metadata.shared > gpu.shared_memory_per_block_optin:
                problem = OutOfResources(metadata.shared, gpu.shared_memory_per_block_optin, "shared memory")
            elif metadata.num_warps * gpu.warp_size > gpu.max_threads_per_block:
                problem = OutOfResources(metadata.num_warps * gpu.warp_size, gpu.max_threads_per_block, "threads")
            fitting += problem is None
            error = problem or error
            COMPILED.append(
                Kernel(
                    name=self.inductor_meta.get("kernel_name", getattr(self.fn, "__name__", "?")),
                    shared=metadata.shared,
                    num_warps=metadata.num_warps,
                    num_stages=metadata.num_stages,
                    ptx=result.kernel.asm.get("ptx", ""),
                    error=None if problem is None else str(problem),
                )
            )
        if results and not fitting:
            raise RuntimeError(f"No valid triton configs. {type(error).__name__}: {error}")
        self.launchers = [None] * len(results)

    triton_heuristics.CachingAutotuner._make_launchers = make_launchers
    triton_heuristics.CachingAutotuner._dynamic_scale_rblock = lambda self: None
    triton_heuristics.CachingAutotuner.run = lambda self, *args, **kwargs: None  # a launch into nothing


def never_run(*args: Any) -> Any:
    """What a compile-only backend returns for a graph: there is no GPU to run it on."""
    raise NotRunError(f"compiled for the fake {installed().key}; nothing runs")
