"""torch_npu's extension module, `torch_npu._C`: only the submodule afd reaches (_distributed_c10d)."""
