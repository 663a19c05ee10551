"""speccal.costmodel"""
