"""glmpost: GLM-style post-training beyond SFT as Unix-style stages (NPU, CUDA, CPU)."""

__version__ = "0.1.0"
