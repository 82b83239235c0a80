"""caches"""
