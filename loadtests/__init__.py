"""loadtests"""
