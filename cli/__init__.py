"""tierflow.cli"""
