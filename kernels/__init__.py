"""speccal.kernels"""
