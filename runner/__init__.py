"""speccal.runner"""
