"""speccal.calibrate"""
