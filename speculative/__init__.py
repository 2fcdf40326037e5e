"""tierflow.speculative"""
