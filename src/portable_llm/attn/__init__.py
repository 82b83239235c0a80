"""attn"""
