"""tierflow.gpu_kernels"""
