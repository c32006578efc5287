"""Checks users wish they had: is my data-parallel setup equivalent, are parameters unused?"""
