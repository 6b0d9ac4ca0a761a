"""lowprec.utils.tensors.local_data: the plain tensor behind the wrappers engines put around parameters."""

import torch

from lowprec.backends.msamp.fsdp import FP8MasterWeight
from lowprec.utils.tensors import local_data


def test_plain_tensors_are_their_own_data():
    t = torch.randn(3, 4)
    assert local_data(t) is t


def test_a_wrapper_subclass_gives_its_inner_tensor_whose_pointer_kernels_can_use():
    inner = torch.randn(8, 4).half()
    wrapped = torch.nn.Parameter(FP8MasterWeight(inner))
    data = local_data(wrapped)
    assert data.data_ptr() == inner.data_ptr() != 0 and data.dtype == torch.float16
    assert wrapped.data_ptr() == inner.data_ptr()  # what Accelerate's FSDP2 optimizer remap keys on

