// The source that builds ddp_torch_program_pch's precompiled <torch/torch.h> (CMakeLists.txt).
// It has nothing of its own: the object library exists only to own the header.
