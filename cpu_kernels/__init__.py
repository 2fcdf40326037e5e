"""tierflow.cpu_kernels"""
