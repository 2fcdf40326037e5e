"""tierflow.runtime"""
