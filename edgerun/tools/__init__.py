"""Tools that run the model: conversion with calibration, imatrix, perplexity."""
