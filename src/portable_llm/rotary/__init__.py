"""rotary"""
