module @jit_s1_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.create_token : !stablehlo.token
    %1:2 = "stablehlo.recv"(%0) <{channel_handle = #stablehlo.channel_handle<handle = 4, type = 1>, is_host_transfer = false}> {mhlo.frontend_attributes = {mpmdc.dst_mesh = "1", mpmdc.src_mesh = "2"}} : (!stablehlo.token) -> (tensor<4x16xf32>, !stablehlo.token)
    %2 = stablehlo.multiply %1#0, %arg0 : tensor<4x16xf32>
    %3 = stablehlo.multiply %2, %arg1 : tensor<4x16xf32>
    %4 = stablehlo.add %2, %3 : tensor<4x16xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<4x16xf32>, tensor<f32>) -> tensor<16xf32>
    %6 = stablehlo.reshape %5 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %7 = stablehlo.reduce(%6 init: %cst_0) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %8 = stablehlo.dot_general %4, %arg2, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<16x16xf32>
    %9 = stablehlo.transpose %8, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %10 = stablehlo.dot_general %4, %arg3, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<16x16xf32>) -> tensor<4x16xf32>
    %11 = stablehlo.create_token : !stablehlo.token
    %12 = "stablehlo.send"(%10, %11) <{channel_handle = #stablehlo.channel_handle<handle = 5, type = 1>, is_host_transfer = false}> {mhlo.frontend_attributes = {mpmdc.dst_mesh = "0", mpmdc.src_mesh = "1"}} : (tensor<4x16xf32>, !stablehlo.token) -> !stablehlo.token
    return %7, %9 : tensor<16xf32>, tensor<16x16xf32>
  }
}
